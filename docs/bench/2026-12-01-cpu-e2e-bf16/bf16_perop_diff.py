"""(Recorded CPU measurement, kept here with its data; until 2026-12-02 it lived in the scripts folder.)
Per-op bf16 diff: a vLLM 0.32 CPU model (in-process) vs ours on the same prompt, layer by layer.

    .venv-vllm/bin/python docs/bench/2026-12-01-cpu-e2e-bf16/bf16_perop_diff.py [NUM_TOKENS]   (LAYERS=29: all layers)

Runs in the decode venv (vLLM and our package, installed there by scripts/setup.sh). Hooks record
each layer's input norm, attention inputs (q, k, v after rope) and output, o_proj and down_proj
outputs in vLLM; ours records the same; each cell prints "differing values / all, max |diff|".
This is how the bf16 differences behind docs/e2e-cpu-notes.md were found.
"""
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
import torch
from vllm import LLM, SamplingParams
from prefill_server.models.registry import resolve_model
path = str(resolve_model(None))
llm = LLM(model=path, dtype="bfloat16", block_size=32, max_model_len=4096, enforce_eager=True,
          enable_prefix_caching=False, max_num_batched_tokens=2048)
V = {}
def hooks(model):
    def save(name, kind):
        def f(mod, args, out):
            if kind == "in":
                V[name] = [a.detach().clone() for a in args if torch.is_tensor(a)]
            else:
                V[name] = [o.detach().clone() for o in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(o)]
        return f
    for i, L in enumerate(model.model.layers[:30]):
        L.self_attn.attn.register_forward_hook(lambda m, a, o, i=i: V.__setitem__(f"{i}.attn_in", [x.detach().clone() for x in a[:3]]) or V.__setitem__(f"{i}.attn_out", [o.detach().clone()]))
        L.self_attn.o_proj.register_forward_hook(save(f"{i}.o_proj", "out"))
        L.mlp.down_proj.register_forward_hook(save(f"{i}.down", "out"))
        L.input_layernorm.register_forward_hook(save(f"{i}.in_norm", "out"))
    model.model.embed_tokens.register_forward_hook(save("embed", "out"))
    return type(model).__name__
print(llm.apply_model(hooks))
text = open("/usr/share/common-licenses/GPL-3").read()[:2000]
ids = llm.get_tokenizer().encode(text)[:int(sys.argv[1]) if len(sys.argv) > 1 else 11]
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0, logprobs=2))
print("vllm first token logprobs", out[0].outputs[0].logprobs)
vl = {k: [t.float().clone() for t in v] for k, v in V.items()}
# ours
from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.layers.attention import dense_attention, set_cpu_backend
torch.set_num_threads(1)
set_cpu_backend("vllm", None, 32, query_chunk=2048)
m = build.load(EngineConfig(model=path, dtype="bfloat16"))
O = {}
def osave(name):
    def f(mod, args, out): O[name] = [o.detach().float().clone() for o in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(o)]
    return f
for i, L in enumerate(m.model.model.layers):
    L.self_attn.o_proj.register_forward_hook(osave(f"{i}.o_proj"))
    L.mlp.down_proj.register_forward_hook(osave(f"{i}.down"))
    L.input_layernorm.register_forward_hook(osave(f"{i}.in_norm"))
m.model.model.embed_tokens.register_forward_hook(osave("embed"))
scale = m.config.head_dim ** -0.5
def attn(l, q, k, v):
    O[f"{l}.attn_in"] = [q.float().clone(), k.float().clone(), v.float().clone()]
    o = dense_attention(q, k, v, scale); O[f"{l}.attn_out"] = [o.float().reshape(o.shape[0], -1).clone()]; return o
logits = m.model(torch.tensor(ids), torch.arange(len(ids)), attn, torch.tensor([len(ids) - 1]))[0]
lp = torch.log_softmax(logits, -1).topk(2)
print("ours first token", lp)
def cmp(name, a, b):
    a = a.reshape(a.shape[0], -1); b = b.reshape(b.shape[0], -1)
    n = min(a.shape[0], b.shape[0])
    d = (a[:n] != b[:n]).sum().item()
    return f"{d}/{a[:n].numel()} maxabs {(a[:n]-b[:n]).abs().max().item():.3g}"
print("embed", cmp("e", vl["embed"][0], O["embed"][0]))
for i in range(30):
    row = []
    for key in ["in_norm", "attn_in", "attn_out", "o_proj", "down"]:
        va, oa = vl.get(f"{i}.{key}"), O.get(f"{i}.{key}")
        if va is None or oa is None: continue  # vLLM's fused add+norm returns a tuple: layer 0 only
        row.append(f"{key}: " + "; ".join(cmp(key, x, y) for x, y in zip(va, oa)))
    print(i, " | ".join(row), flush=True)
    if i >= int(os.environ.get("LAYERS", "3")): break
