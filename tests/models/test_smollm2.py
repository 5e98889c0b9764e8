"""The embedded default model: GGUF conversion (dequantization, q/k row order), our forward against
transformers on the converted folder, and a greedy continuation that knows its geography."""
from __future__ import annotations

import json

import pytest
import torch

from hf_reference import rel_err
from prefill_server.models.reference_attention import CausalAttention
from prefill_server.models.tokenizer import Tokenizer
from prefill_server.models.weights import load_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_fp32(smollm_dir):
    return load_model(smollm_dir, dtype=torch.float32)


def test_converted_folder(smollm_dir):
    cfg = json.loads((smollm_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    tok_cfg = json.loads((smollm_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")
    assert json.loads((smollm_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_dequantized_weights_equal_transformers_gguf(smollm_gguf):
    """Every tensor equals transformers' own GGUF dequantization (incl. undoing llama.cpp's q/k permute)."""
    transformers = pytest.importorskip("transformers")
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    from gguf import GGUFReader

    from prefill_server.models.gguf_convert import iter_hf_tensors, read_config

    hf_cfg = transformers.AutoConfig.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)
    with torch.device("meta"):
        meta_model = transformers.LlamaForCausalLM(hf_cfg)
    ref = gguf_utils.load_gguf_checkpoint(str(smollm_gguf), return_tensors=True, model_to_load=meta_model)["tensors"]
    reader = GGUFReader(str(smollm_gguf))
    seen = 0
    for name, w in iter_hf_tensors(reader, read_config(reader)):
        assert torch.equal(w, torch.as_tensor(ref[name]).float()), name
        seen += 1
    assert seen == len(ref) == 272


def test_logits_match_transformers_on_converted_folder(smollm_dir, model_fp32):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    cfg, model = model_fp32
    ids = torch.tensor(Tokenizer(smollm_dir).encode(PROMPT + " Paris, and the capital of Italy is Rome."))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = model(ids, torch.arange(len(ids)), CausalAttention.single(len(ids)))
    assert rel_err(ours, ref) <= 1e-4


def greedy(model, tok, prompt: str, steps: int) -> str:
    ids = tok.encode(prompt)
    for _ in range(steps):
        n = len(ids)
        logits = model(torch.tensor(ids), torch.arange(n), CausalAttention.single(n), torch.tensor([n - 1]))
        ids.append(int(logits[0].argmax()))
    return tok.decode(ids[len(tok.encode(prompt)):])


@pytest.fixture(scope="module")
def model_bf16(smollm_dir):
    return load_model(smollm_dir)  # the folder's dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_continuation_knows_paris(smollm_dir, model_fp32, model_bf16, dtype):
    model = (model_fp32 if dtype == torch.float32 else model_bf16)[1]
    assert model.lm_head.weight.dtype == dtype
    assert greedy(model, Tokenizer(smollm_dir), PROMPT, 2).startswith(" Paris")


def test_greedy_chat_answer_knows_paris(smollm_dir, model_bf16):
    tok = Tokenizer(smollm_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in greedy(model_bf16[1], tok, chat, 7)
