"""FP8 linear layers on the real SmolLM2-135M-Instruct (issue 20), CPU, the emulated FP8 path (the
same quantization as the GPU's, float32 sums): next-token top-1 agreement with the unquantized model
over the last 256 positions of 8K-token texts, needle-in-a-haystack retrieval at three depths, and
how far the K/V this server would send move (relative L2 error per layer). Run from the repo root:

    .venv/bin/python docs/bench/2026-12-03-fp8/accuracy.py --out docs/bench/2026-12-03-fp8/accuracy.json

The reference is the model in float32 (bf16 matmuls on a CPU without AVX-512 BF16 are slow, and
float32 is the stricter reference); the FP8 model is a deep copy with ``quantize_model`` applied.
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests" / "kernels"))
import bsa_accuracy as acc  # noqa: E402  (the texts, the needle cases and the dense attention)

from prefill_server.layers.fp8 import quantize_model  # noqa: E402


def kv_error(ref: acc.Dense, got: acc.Dense) -> dict:
    errs = {}
    for layer in sorted(ref.qkv):
        _, k0, v0 = ref.qkv[layer]
        _, k1, v1 = got.qkv[layer]
        errs[layer] = {"k": ((k1 - k0).norm() / k0.norm()).item(), "v": ((v1 - v0).norm() / v0.norm()).item()}
    ks, vs = [e["k"] for e in errs.values()], [e["v"] for e in errs.values()]
    return {"k_mean": sum(ks) / len(ks), "k_max": max(ks), "v_mean": sum(vs) / len(vs), "v_max": max(vs),
            "per_layer": errs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", default="gpl3,held_out")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _, ref_model, tok = acc.load()
    fp8_model = quantize_model(copy.deepcopy(ref_model))
    res: dict = {"model": "SmolLM2-135M-Instruct", "reference": "float32", "fp8": "emulated e4m3, per-channel "
                 "weights, per-token activations", "tokens": a.tokens, "texts": {}, "needle": []}
    for name in a.texts.split(","):
        ids = acc.text_ids(tok, name, a.tokens)
        t0 = time.time()
        d_ref, d_fp8 = acc.Dense(record=True), acc.Dense(record=True)
        lr = acc.forward(ref_model, ids, d_ref, 256)
        lf = acc.forward(fp8_model, ids, d_fp8, 256)
        top1 = (lr.argmax(-1) == lf.argmax(-1)).float().mean().item()
        res["texts"][name] = {"top1_agreement": top1, "kv_rel_err": kv_error(d_ref, d_fp8),
                              "s": round(time.time() - t0)}
        print(name, "top-1", round(top1, 4), "K err mean/max", round(res["texts"][name]["kv_rel_err"]["k_mean"], 4),
              round(res["texts"][name]["kv_rel_err"]["k_max"], 4), "V", round(res["texts"][name]["kv_rel_err"]["v_mean"], 4),
              round(res["texts"][name]["kv_rel_err"]["v_max"], 4), flush=True)
        del d_ref, d_fp8
    hay = acc.text_ids(tok, "gfdl_lgpl", a.tokens + 512)
    for depth in [float(x) for x in a.depths.split(",")]:
        ids, n_ans = acc.needle_case(tok, hay, a.tokens + 1, depth, acc.VALUES[0])
        row = {"depth": depth, "reference": acc.retrieved(ref_model, ids, n_ans, acc.Dense()),
               "fp8": acc.retrieved(fp8_model, ids, n_ans, acc.Dense())}
        res["needle"].append(row)
        print("needle", row, flush=True)
    pathlib.Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
