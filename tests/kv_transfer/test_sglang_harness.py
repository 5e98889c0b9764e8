"""SGLang 0.5.23's own decode-side transfer classes, as a test peer: run as a script in
``.venv-sglang`` (``scripts/setup_sglang.sh``), it builds what an SGLang decode scheduler builds for
the NIXL backend on CPU -- ``MHATokenToKVPool`` (DRAM), ``MetadataBuffers``, ``KVArgs``,
``NixlKVManager(DECODE)`` with its listener and heartbeat threads -- and drives ``NixlKVReceiver``
per request as ``DecodePreallocQueue`` does (``try_ensure_parallel_info``, ``init``,
``send_metadata``, ``poll``, ``abort``), answering JSON commands on stdin. Nothing of SGLang is
patched; only the runtime context a launcher would publish (server args, ranks) is set.

``SGLangDecode`` (imported by the tests) starts it and calls it. This file holds no tests: pytest
imports it harmlessly (SGLang is imported only under ``__main__``, in the SGLang venv).
"""
from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def venv_missing() -> str | None:
    """Why the SGLang tests cannot run here, or None."""
    if not VENV_PYTHON.exists():
        return f"{VENV_PYTHON} is missing: run scripts/setup_sglang.sh (sglang==0.5.23, CPU, ~6 GB)"
    return None


class SGLangDecode:
    """One harness process; ``call(op, **args)`` -> its JSON answer (raises RuntimeError on
    ``{"error": ...}`` unless ``check=False``)."""

    def __init__(self, log_path: pathlib.Path, heartbeat_s: float = 2.0, start_timeout_s: float = 240.0):
        env = dict(os.environ, SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL=str(heartbeat_s),
                   PYTHONWARNINGS="ignore", UCX_LOG_LEVEL="error")
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([str(VENV_PYTHON), __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, text=True, bufsize=1)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._wait(start_timeout_s)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait(self, timeout_s: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the SGLang harness did not answer within {timeout_s} s; log:\n{self.log_tail()}")
        if line is None:
            raise RuntimeError(f"the SGLang harness exited; log:\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-n:]

    def call(self, op: str, timeout_s: float = 120.0, check: bool = True, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        out = self._wait(timeout_s)
        if check and "error" in out:
            raise RuntimeError(f"harness {op}: {out['error']}")
        return out

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("quit", timeout_s=10, check=False)
        except (RuntimeError, OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


# ---------------------------------------------------------------- the harness (SGLang venv only)
def _serve() -> None:  # pragma: no cover - runs in .venv-sglang
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # SGLang's and NIXL's prints go to the log, never into our replies
    sys.stdout = sys.stderr
    import time

    import numpy as np
    import torch
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver
    from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="harness", device="cpu", disaggregation_mode="decode",
                    disaggregation_transfer_backend="nixl")
    get_context().set_server_args(sa)
    # what the launcher publishes for a single-rank decode (no torch.distributed here)
    get_parallel().override_permanently(tp_rank=0, pp_rank=0, dp_rank=0, attn_tp_rank=0, attn_cp_rank=0,
                                        attn_dp_rank=0, attn_dcp_rank=0, moe_ep_rank=0, moe_tp_rank=0)
    decodes: dict = {}
    receivers: dict = {}

    def make_decode(name, page_size, layers, heads, head_dim, dtype="float32", pages=64,
                    kv_cache_dtype="auto", aux_rows=32):
        pool = MHATokenToKVPool(size=pages * page_size, page_size=page_size, dtype=getattr(torch, dtype),
                                head_num=heads, head_dim=head_dim, layer_num=layers, device="cpu",
                                enable_memory_saver=False)
        meta = MetadataBuffers(aux_rows, hidden_size=16, hidden_states_dtype=torch.float32,
                               max_sampling_mask_tokens=sa.sampling_mask_max_tokens)
        kv = KVArgs()  # as DecodePreallocQueue._init_kv_manager fills it for an MHA pool
        kv.engine_rank, kv.pp_rank, kv.system_dp_rank = 0, 0, 0
        kv.kv_cache_dtype_str, kv.kv_layout = kv_cache_dtype, None
        kv.kv_data_ptrs, kv.kv_data_lens, kv.kv_item_lens = pool.get_contiguous_buf_infos()
        kv.kv_data_mem_kinds = ["DRAM"] * len(kv.kv_data_ptrs)
        kv.num_draft_entries, kv.kv_layer_ids, kv.page_size = 0, [], page_size
        kv.aux_data_ptrs, kv.aux_data_lens, kv.aux_item_lens = meta.get_buf_infos()
        kv.state_types, kv.state_data_ptrs, kv.state_data_lens, kv.state_item_lens = [], [], [], []
        kv.state_dim_per_tensor, kv.state_slice_outer_counts, kv.state_layer_ids = [], [], []
        kv.is_hybrid_mla_backend, kv.state_conv_shard_groups, kv.swa_kv_cache_layout = False, [], None
        kv.mla_compression_ratios, kv.ib_device, kv.gpu_id = None, None, 0
        mgr = NixlKVManager(kv, DisaggregationMode.DECODE, sa, False)
        decodes[name] = (mgr, pool, meta, page_size)
        return {"port": mgr.rank_port}

    def request(decode, room, addr, pages, aux, prefix=0):
        mgr = decodes[decode][0]
        r = receivers[(decode, room)] = NixlKVReceiver(mgr, addr, room)
        try:  # DecodePreallocQueue: the prefill's parallel info first (mismatches raise there)
            ok = mgr.try_ensure_parallel_info(addr)
        except RuntimeError as e:
            r.abort()
            return {"refused": str(e)}
        if not ok:
            return {"refused": "could not fetch the prefill's parallel info"}
        r.init(prefill_dp_rank=0)
        if r.poll() == 2:  # WaitingForInput: pages allocated, metadata sent
            r.send_metadata(np.array(pages, dtype=np.int32), aux, None, decode_prefix_len=prefix)
        return {"state": int(r.poll())}

    def poll(decode, room, timeout_s=30.0, until=(0, 4)):
        mgr, r = decodes[decode][0], receivers[(decode, room)]
        deadline = time.monotonic() + timeout_s
        while (s := int(r.poll())) not in until and time.monotonic() < deadline:
            time.sleep(0.01)
        with mgr.failure_lock:
            reason = mgr.failure_records.get(room)
        return {"state": s, "reason": reason}

    def peek(decode, room):  # poll once (callers that wait themselves, between other calls)
        return poll(decode, room, timeout_s=0)

    def read(decode, room, pages, aux, path):
        _, pool, meta, ps = decodes[decode]
        rows = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])
        kv = torch.stack([torch.stack([pool.k_buffer[i][rows], pool.v_buffer[i][rows]])
                          for i in range(len(pool.k_buffer))])  # [L, 2, pages * ps, H, D]
        kv.float().numpy().tofile(path)
        buf = meta.get_buf(aux)  # SGLang's own accessor, as _commit_transfer_to_req reads it
        return {"output_id": int(buf[0][0]), "room": int(buf[-1][0]), "cached_tokens": int(buf[1][0]),
                "logprob": float(buf[2][0]), "logprob_idx": int(buf[3][0]),
                "top_val": buf[4][:8].tolist(), "top_idx": buf[5][:8].tolist()}

    def clear(decode, room):
        r = receivers.pop((decode, room))
        try:
            r.failure_exception() if int(r.poll()) == 0 else r.clear()
        except KVTransferError as e:
            return {"cleared": str(e)}
        return {"cleared": ""}

    def abort(decode, room, timeout_s=10.0):
        mgr, r = decodes[decode][0], receivers[(decode, room)]
        r.abort()  # DecodeTransferQueue then holds the pages until every prefill rank acked
        deadline = time.monotonic() + timeout_s
        while not (acked := mgr.is_abort_release_safe(room, 1)) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"acked": acked, "state": int(r.poll())}

    def heartbeat(decode, addr):
        mgr = decodes[decode][0]
        return {"known": addr in mgr.prefill_info_table, "failures": mgr.heartbeat_failures.get(addr, 0)}

    def server_info(model_path, page_size=1, port=30000, bootstrap_port=8998, max_total_num_tokens=0):
        """What an SGLang decode's ``GET /server_info`` answers (http_server.server_info): its own
        ``build_server_info`` over ServerArgs resolved from a decode's command line, plus the fields
        that handler adds (its live ``internal_states`` are left empty)."""
        from sglang import __version__
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.utils.common import build_server_info

        args = prepare_server_args(["--model-path", model_path, "--device", "cpu", "--disaggregation-mode", "decode",
                                    "--disaggregation-transfer-backend", "nixl", "--page-size", str(page_size),
                                    "--disaggregation-bootstrap-port", str(bootstrap_port),
                                    "--host", "127.0.0.1", "--port", str(port)])
        args.resolve_once()
        info = build_server_info(args, {"status": "ready", "max_total_num_tokens": max_total_num_tokens,
                                        "max_req_input_len": max_total_num_tokens, "startup_time": time.time()})
        info.update(internal_states=[], version=__version__, frontend="python")
        return {"server_info": json.loads(json.dumps(info, default=str))}

    ops = {"decode": make_decode, "request": request, "poll": poll, "read": read, "clear": clear,
           "abort": abort, "heartbeat": heartbeat, "server_info": server_info, "peek": peek}
    replies.write(json.dumps({"ok": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            replies.write(json.dumps({"ok": True}) + "\n")
            break
        try:
            out = ops[op](**cmd)
        except Exception as e:  # noqa: BLE001 - the test sees the error, the harness lives on
            import traceback

            traceback.print_exc()
            out = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(out) + "\n")
    os._exit(0)  # SGLang's listener threads are not daemons everywhere


if __name__ == "__main__":
    _serve()
