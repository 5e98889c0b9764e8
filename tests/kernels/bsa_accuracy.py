"""Sparse-vs-dense accuracy of block-sparse attention on the embedded SmolLM2-135M-Instruct (CPU).

Used by ``test_accuracy_smollm2.py`` and runnable for the measurements behind the defaults:

    .venv/bin/python tests/kernels/bsa_accuracy.py sweep   # per-layer missed attention mass vs density
    .venv/bin/python tests/kernels/bsa_accuracy.py eval    # top-1 agreement + needle retrieval

Texts are real English every Debian machine has (/usr/share/common-licenses). Attention runs through
the model's ``attn(layer, q, k, v)`` callable: dense = exact causal softmax; sparse = ``plan``/``run``
with the torch backend (the same selection the Triton estimator makes, see test_block_sparse_triton).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time

import torch

from prefill_server.kernels.block_sparse import SparseConfig, build_layout, plan
from prefill_server.kernels.block_sparse import reference as ref

LICENSES = pathlib.Path("/usr/share/common-licenses")
TEXTS = {  # name -> files concatenated (each long enough for 8K tokens)
    "gpl3": ["GPL-3", "GPL-2"],
    "gfdl_lgpl": ["GFDL-1.3", "LGPL-2.1", "Apache-2.0"],
    "mpl_gpl2": ["MPL-1.1", "GPL-2", "MPL-2.0"],
    "held_out": ["Artistic", "GPL-1", "LGPL-3", "CC0-1.0", "BSD", "Apache-2.0"],  # not used to pick defaults
}


def available() -> bool:
    return all((LICENSES / f).is_file() for fs in TEXTS.values() for f in fs)


def load():
    from prefill_server.models.registry import resolve_model
    from prefill_server.models.tokenizer import Tokenizer
    from prefill_server.models.weights import load_model

    path = resolve_model(None)
    cfg, model = load_model(path, dtype=torch.float32)
    return cfg, model, Tokenizer(path)


def text_ids(tok, name: str, n: int) -> list[int]:
    text = "\n\n".join((LICENSES / f).read_text(errors="replace") for f in TEXTS[name])
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) >= n, (name, len(ids))
    return ids[:n]


class Dense:
    """Exact causal attention (one sequence); optionally records q/k/v per layer."""

    def __init__(self, record: bool = False):
        self.record = record
        self.qkv: dict[int, tuple] = {}

    def __call__(self, layer, q, k, v):
        if self.record:
            self.qkv[layer] = (q.clone(), k.clone(), v.clone())
        g = q.shape[1] // k.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1),
            v.repeat_interleave(g, 1).transpose(0, 1), is_causal=True)
        return o.transpose(0, 1)


class Sparse:
    """``plan`` + ``run`` per layer (torch backend); records each layer's density. ``layer0``:
    SparseConfig overrides for layer 0 only (e.g. a forced budget for a sparse first layer)."""

    def __init__(self, cfg: SparseConfig, layer0: dict | None = None):
        self.cfg = dataclasses.replace(cfg, backend="torch")
        self.cfg0 = dataclasses.replace(self.cfg, **layer0) if layer0 else self.cfg
        self.density: dict[int, float] = {}
        self._layout = None

    def __call__(self, layer, q, k, v):
        n = q.shape[0]
        cu = torch.tensor([0, n], dtype=torch.int32)
        if self._layout is None or self._layout.total_q != n:
            self._layout = build_layout(cu, cu, n, n, self.cfg.block_size)
        p = plan(q, k, cu, cu, self.cfg0 if layer == 0 else self.cfg, layer=layer, layout=self._layout)
        self.density[layer] = p.density()
        return p.run(q, k, v)[0]

    def mean_density(self, skip_dense_layers: bool = True) -> float:
        first = self.cfg.first_dense_layers(self._layout.total_k if self._layout else None)
        vals = [d for l, d in self.density.items() if not (skip_dense_layers and l < first)]
        return sum(vals) / max(len(vals), 1)


def forward(model, ids: list[int], attn, last: int) -> torch.Tensor:
    x = torch.tensor(ids)
    idx = torch.arange(len(ids) - last, len(ids))
    return model(x, torch.arange(len(ids)), attn, logits_indices=idx)  # [last, vocab]


def agreement(model, ids, cfg: SparseConfig, last: int = 256, dense_logits=None, layer0: dict | None = None,
              per_layer: dict | None = None):
    """(top-1 agreement over the last ``last`` positions, mean sparse-layer density, dense logits).
    ``layer0``: see ``Sparse``; ``per_layer``: filled with each layer's density."""
    if dense_logits is None:
        dense_logits = forward(model, ids, Dense(), last)
    sp = Sparse(cfg, layer0)
    sparse_logits = forward(model, ids, sp, last)
    agree = (sparse_logits.argmax(-1) == dense_logits.argmax(-1)).float().mean().item()
    if per_layer is not None:
        per_layer.update(sp.density)
    return agree, sp.mean_density(), dense_logits


# ----------------------------------------------------------------------------- needle in a haystack
NEEDLE = "The secret passphrase for the archive is {value}. Remember it."
QUESTION = "\n\nQuestion: What is the secret passphrase for the archive?\nAnswer: The secret passphrase for the archive is"
VALUES = ["tangerine seventeen", "marble falcon", "copper lantern", "violet harbor"]


def needle_case(tok, hay_ids: list[int], n: int, depth: float, value: str):
    """``n`` token ids: haystack with the needle at ``depth``, the question, then the answer (whose
    length is returned). ``retrieved`` runs ids[:-1] (n - 1 tokens) and teacher-forces the answer:
    retrieval = every answer token is the argmax."""
    needle = tok.encode(" " + NEEDLE.format(value=value) + " ", add_special_tokens=False)
    q = tok.encode(QUESTION, add_special_tokens=False)
    ans = tok.encode(" " + value, add_special_tokens=False)
    body = n - len(needle) - len(q) - len(ans)
    cut = int(body * depth)
    ids = hay_ids[:cut] + needle + hay_ids[cut:body] + q + ans
    return ids, len(ans)


def retrieved(model, ids, n_ans: int, attn) -> bool:
    logits = forward(model, ids[:-1], attn, n_ans)  # predictions for the answer tokens
    return bool((logits.argmax(-1) == torch.tensor(ids[-n_ans:])).all())


# ----------------------------------------------------------------------------- per-layer sweep
def block_mass(q, k, bs: int, chunk: int = 1024) -> torch.Tensor:
    """Exact attention mass of each query on each key block: [Hq, T, nkb] (float32)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    nkb = -(-t // bs)
    out = torch.zeros(hq, t, nkb)
    kk = k.repeat_interleave(g, 1).transpose(0, 1)  # [Hq, T, D]
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        sc = torch.einsum("qhd,hkd->hqk", q[s:e], kk) / math.sqrt(d)
        mask = torch.arange(t)[None, :] > torch.arange(s, e)[:, None]
        p = torch.softmax(sc.masked_fill(mask, float("-inf")), -1)  # [Hq, n, T]
        p = torch.nn.functional.pad(p, (0, nkb * bs - t))
        out[:, s:e] = p.view(hq, e - s, nkb, bs).sum(-1)
    return out


def missed_mass(mass: torch.Tensor, sel: torch.Tensor, layout, bs: int) -> float:
    """Mean over queries and heads of the dense attention mass outside the computed blocks."""
    hq, t, nkb = mass.shape
    hkv = sel.shape[1]
    from prefill_server.kernels.block_sparse.layout import slot_geometry
    lo, hi, _ = slot_geometry(layout)
    col = torch.arange(nkb)
    keep = sel[:, :, :nkb] | (col[None, None, :] >= lo[:, None, None])  # diagonal region always
    keep_q = keep[torch.arange(t) // bs]  # [T, Hkv, nkb]
    keep_h = keep_q.repeat_interleave(hq // hkv, 1).permute(1, 0, 2)  # [Hq, T, nkb]
    return float(1 - (mass * keep_h).sum(-1).mean())


def sweep(model, tok, n: int = 4096, configs=None, text: str = "gpl3"):
    ids = text_ids(tok, text, n)
    rec = Dense(record=True)
    forward(model, ids, rec, 1)
    cu = torch.tensor([0, n], dtype=torch.int32)
    lay = build_layout(cu, cu, n, n, 128)
    masses = {l: block_mass(q, k, 128) for l, (q, k, v) in rec.qkv.items()}
    rows = []
    for c in configs:
        dens, miss = [], []
        for l, (q, k, v) in rec.qkv.items():
            if l < c.first_dense_layers(n):
                continue
            sel = ref.estimate(q, k, lay, c)
            dens.append(ref.density(sel, lay))
            miss.append(missed_mass(masses[l], sel, lay, 128))
        rows.append({"config": {f: getattr(c, f) for f in ("threshold", "q_pool", "sink_blocks",
                                                           "local_blocks", "probe_queries",
                                                           "probe_threshold")},
                     "density": sum(dens) / len(dens), "missed_mass_mean": sum(miss) / len(miss),
                     "missed_mass_max_layer": max(miss)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv):
    cfg_m, model, tok = load()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if argv and argv[0] == "sweep":
        base = SparseConfig(dense_len_threshold=0)
        configs = []
        for thr in (0.3, 0.1, 0.03, 0.01):
            for qp in (16, 64):
                configs.append(dataclasses.replace(base, threshold=thr, q_pool=qp))
        for pt in (0.0, 0.02, 0.005):  # probe off / on
            configs.append(dataclasses.replace(base, threshold=0.1, probe_queries=64 if pt else 0,
                                               probe_threshold=pt or 0.005))
        for lb in (1, 4):
            configs.append(dataclasses.replace(base, threshold=0.1, local_blocks=lb))
        if len(argv) > 1:  # sweep '[{config}, ...]'
            configs = [dataclasses.replace(base, **c) for c in json.loads(argv[1])]
        sweep(model, tok, configs=configs)
    elif argv and argv[0] == "eval":  # eval TEXT N '{config..., "layer0": {overrides}}' ...
        name, n = argv[1], int(argv[2])
        ids = text_ids(tok, name, n)
        t0 = time.time()
        dense_logits = forward(model, ids, Dense(), 256)
        print("dense", round(time.time() - t0), "s", flush=True)
        for js in argv[3:]:
            kw = json.loads(js)
            layer0 = kw.pop("layer0", None)
            cfg = SparseConfig(**kw)
            t0 = time.time()
            per = {}
            a, d, _ = agreement(model, ids, cfg, dense_logits=dense_logits, layer0=layer0, per_layer=per)
            rest = [v for l, v in per.items() if l > 0]
            print(json.dumps({"text": name, "tokens": n, "config": json.loads(js), "top1": a,
                              "density": d, "density_layer0": per.get(0),
                              "density_layers_1_up": sum(rest) / max(len(rest), 1),
                              "s": round(time.time() - t0)}), flush=True)
    elif argv and argv[0] == "needle":  # needle N DEPTH,DEPTH '{config}'
        n = int(argv[1])
        hay = text_ids(tok, "gfdl_lgpl", 8192 + 512)
        cfg = SparseConfig(**json.loads(argv[3]))
        for depth in [float(x) for x in argv[2].split(",")]:
            ids, n_ans = needle_case(tok, hay, n, depth, VALUES[0])
            sp = Sparse(cfg)
            res = {"tokens": n, "depth": depth, "dense": retrieved(model, ids, n_ans, Dense()),
                   "sparse": retrieved(model, ids, n_ans, sp), "density": sp.mean_density()}
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
