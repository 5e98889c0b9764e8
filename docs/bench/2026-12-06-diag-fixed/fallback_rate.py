"""How often the fixed-reference fast path would fall back on real logits, for the two references:
fixm 1 (the row max over the item's whole diagonal region) and fixm 2 (the row max over the first
diagonal tile that reaches past the item's first query). CPU: post-RoPE Q/K of SmolLM2-135M-Instruct
(``tests/kernels/bsa_accuracy.py``'s loader and text) at N tokens, every layer; dense mode (every
causal key counted, the largest l a row can have). The kernel's program at G=3 is 1 head x TOK=128
tokens (``kernel.default_tiling``), BN=64: fixm 2's tile is then the first 64 keys of the query's block.
Also evaluated with TOK=32 (the 8B shape's program height) on the same logits. A row falls back when
log2(l) > log2(FIXM_LIMIT) (15 for fp16 p, 64 for bf16), a program when any of its rows does.

    .venv/bin/python docs/bench/2026-12-06-diag-fixed/fallback_rate.py OUT.json [N]
"""
import json
import math
import sys
import time

import torch

sys.path.insert(0, "tests/kernels")
import bsa_accuracy as acc  # noqa: E402

OUT = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
BS, BN = 128, 64
LIMITS = {"fp16": 15.0, "bf16": 64.0}


def refs(s, tok):
    """[H, T] reference maxima (log2 units) of fixm 1 and fixm 2 for programs of ``tok`` rows."""
    pos = torch.arange(N)
    blk = pos // BS
    diag = blk[None, :] == blk[:, None]  # key in the query's block (keys past the query are -inf in s)
    m1 = s.masked_fill(~diag, float("-inf")).amax(-1)
    tok0 = (pos // tok) * tok  # the item's first query
    tile0 = (tok0 // BN) * BN  # first tile reaching past it (off = 0: tiles start on block edges)
    first = (pos[None, :] >= tile0[:, None]) & (pos[None, :] < tile0[:, None] + BN)
    m2 = s.masked_fill(~first, float("-inf")).amax(-1)
    return m1, m2


def main():
    torch.set_num_threads(2)
    t0 = time.time()
    cfg, model, tk = acc.load()
    ids = acc.text_ids(tk, "gpl3", N)
    rec = acc.Dense(record=True)
    acc.forward(model, ids, rec, 1)
    print(f"forward {time.time() - t0:.1f} s", flush=True)
    out = {"tokens": N, "text": "gpl3", "model": "SmolLM2-135M-Instruct (fp32 on CPU)", "block": BS, "bn": BN,
           "layers": {}}
    pos = torch.arange(N)
    causal = pos[None, :] <= pos[:, None]
    rows_off = pos >= BS
    for layer, (q, k, _v) in sorted(rec.qkv.items()):
        hq, d = q.shape[1], q.shape[2]
        g = hq // k.shape[1]
        entry = {}
        for h in range(hq):
            s = (q[:, h].float() @ k[:, h // g].float().T) * (1 / math.sqrt(d)) * 1.4426950408889634
            s = s.masked_fill(~causal, float("-inf"))
            lse2 = torch.logsumexp(s * math.log(2), -1) / math.log(2)  # log2 of sum exp2(s)
            for tok in (128, 32):
                m1, m2 = refs(s[None], tok)
                for name, m in (("fixm1", m1[0]), ("fixm2", m2[0])):
                    log2_l = (lse2 - m)[rows_off]
                    key = f"tok{tok}_{name}"
                    e = entry.setdefault(key, {"max_log2_l": -1e9, "programs": 0,
                                               **{f"{n}_rows": 0 for n in LIMITS},
                                               **{f"{n}_programs": 0 for n in LIMITS}})
                    e["max_log2_l"] = max(e["max_log2_l"], float(log2_l.max()))
                    full = torch.full((N,), float("-inf"))
                    full[rows_off] = log2_l
                    e["programs"] += N // tok
                    for n, lim in LIMITS.items():
                        bad = full > lim
                        e[f"{n}_rows"] += int(bad.sum())
                        e[f"{n}_programs"] += int(bad.view(-1, tok).any(-1).sum())
            del s
        out["layers"][layer] = entry
        print(layer, {k2: (round(v["max_log2_l"], 1), v["fp16_programs"], v["bf16_programs"])
                      for k2, v in entry.items()}, flush=True)
    tot = {}
    for entry in out["layers"].values():
        for key, e in entry.items():
            t = tot.setdefault(key, {"max_log2_l": -1e9})
            t["max_log2_l"] = max(t["max_log2_l"], e["max_log2_l"])
            for f in ("programs", "fp16_rows", "bf16_rows", "fp16_programs", "bf16_programs"):
                t[f] = t.get(f, 0) + e[f]
    out["total"] = tot
    out["seconds"] = round(time.time() - t0, 1)
    json.dump(out, open(OUT, "w"), indent=1)
    print(json.dumps(tot, indent=1))


if __name__ == "__main__":
    main()
