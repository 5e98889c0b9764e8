"""``bench e2e stream`` at a tiny size on the CPU: the fixed-density adapter computes what it says,
and the whole bench (engine push path -> NIXL over UCX on DRAM -> a receiver in another process)
runs, checks the streamed K/V and writes the JSON it promises."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from prefill_server.bench import sparse, stream, stream_transfer
from prefill_server.kernels.block_sparse import SparseConfig, plan, reference

TINY = "block_size=16,q_pool=16,probe_queries=16,dense_len_threshold=64,local_blocks=1,backend=torch"


def test_sparse_config_overrides():
    c = sparse.sparse_config("dense_first_layers=0,threshold=0.01,backend=torch")
    assert c.dense_first_layers == 0 and c.threshold == 0.01 and c.backend == "torch"
    assert c.block_size == SparseConfig().block_size
    with pytest.raises(SystemExit):
        sparse.sparse_config("no_such_field=1")


def test_only_the_kept_transfer_variants_are_accepted():
    a = stream.parse_args(["--variants", "null-push,nixl", "--long-runs", "copy:0"])
    assert a.variants == ["null-push", "nixl"] and a.long_runs == [("copy", 0)]
    for argv in (["--variants", "nixl-sync"], ["--long-runs", "nixl-reap:0"], ["--estimator-variant", "x"]):
        with pytest.raises(SystemExit):  # the finished experiments are gone
            stream.parse_args(argv)


def test_fixed_density_adapter_runs_its_mask_and_records_the_estimator():
    cfg = sparse.sparse_config(TINY)
    t, hq, hkv, d = 256, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    sp = sparse.BenchSparse(cfg, density=0.4, seed=1)
    assert sp.label == "fixed-0.4" and sp.wants(1, t) and not sp.wants(0, t)
    out = sp.attend(1, q, k, v, d ** -0.5)
    # the kernel computed exactly the prepared fixed mask
    p = sp._fixed[(t, t)]
    ref, _ = reference.attention(q, k, v, p.layout, p.block_mask, d ** -0.5)
    torch.testing.assert_close(out, ref)
    assert abs(sp.mask_density[t] - 0.4) < 0.15
    dens = sp.take_densities()  # the estimator's own choice, recorded on the side
    assert [layer for layer, _ in dens["per_layer"]] == [1] and 0 < dens["mean"] <= 1
    assert sp.take_densities()["mean"] is None  # cleared
    # the estimator mode runs the estimator's own selection
    est = sparse.BenchSparse(cfg)
    cu = torch.tensor([0, t], dtype=torch.int32)
    want = plan(q, k, cu, cu, cfg, layer=1, scale=d ** -0.5).run(q, k, v)[0]
    assert est.label == "estimator"
    torch.testing.assert_close(est.attend(1, q, k, v, d ** -0.5), want)
    assert 0 < est.take_densities()["mean"] <= 1


def test_copy_producer_moves_each_layers_staging_pages():
    from prefill_server.engine.kv_pool import KVPool
    pool = KVPool(num_layers=2, num_blocks=6, num_kv_heads=2, block_size=4, head_dim=8)
    pool.kv.normal_()
    prod = stream_transfer.CopyPush(pool)
    prod.reserve(12)
    assert all(h.shape[0] == 3 for h in prod._host.values())
    rid = "r"
    prod.expect(rid, 12)
    pages = pool.stream_pages([0, 1, 2], 12, 1, 2)  # slot 1 of a 12-token prompt (3 pages)
    prod.layer_done(rid, 1, pages)
    prod.wait_layer(rid, 1)
    flat = pool.kv.view(-1, *pool.kv.shape[2:])
    assert torch.equal(prod._host[1][:3], flat[torch.tensor(pages)])
    assert prod.finish(rid) == {} and not prod.is_ready(rid)


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="NIXL is not installed")
def test_tiny_streamed_run_writes_json(tmp_path):
    out = tmp_path / "stream.json"
    cmd = [sys.executable, "-m", "prefill_server.bench.e2e", "stream", "--preset", "tiny", "--device", "cpu",
           "--dtype", "float32", "--lengths", "256", "--densities", "0.3", "--stream-density", "0.3",
           "--estimator-lengths", "", "--long", "512", "--long-runs", "nixl:0", "--check-len", "128",
           "--variants", "null-push,nixl",
           "--reps", "1", "--sparse", TINY, "--out", str(out)]
    # its own process: NIXL's UCX libraries stay out of this one (see scripts/test.sh)
    p = subprocess.run(cmd, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    assert res["check"]["pass"] and res["check"]["k_rel_err_layer1"] == 0.0
    timed = [r for r in res["runs"] if r["tag"] == "timed"]
    assert {(r["variant"], r["tokens"]) for r in timed} == {
        ("none", 256), ("null-push", 256), ("nixl", 256), ("nixl", 512)}
    for r in timed:
        assert r["ttft_s"] > 0 and r["mode"] == "fixed-0.3" and 0.1 < r["kernel_density"] < 0.6
        if r["variant"] == "nixl":
            page = 2 * 16 * 2 * 16 * 4  # KV heads x tokens x (K|V) x head_dim x fp32
            assert r["receiver"] == "done" and r["kv_bytes"] == 2 * -(-r["tokens"] // 16) * page  # L x pages
            assert r["write_s_median"] is not None
    assert [r["dense_first_layers"] for r in timed if r["tokens"] == 512] == [0]
    rows = {(r["variant"], r["tokens"]): r for r in res["summary"]["rows"]}
    assert rows[("nixl", 256)]["over_no_transfer"] == pytest.approx(
        rows[("nixl", 256)]["ttft_s"] / rows[("none", 256)]["ttft_s"])
