"""CUDA graphs for small steps over a cached prefix: a prefix-cache hit, or a short last chunk.

Why: an eager step of 256 new tokens over an 8K-token cached head launches about 1,500 ops. On the
H200 the host needs 36-48 ms for that while the GPU needs 12.5-18 ms, and the host's speed varies
(docs/bench/2026-12-03-prefix-cache-profile/). The same step replayed as one graph takes about 13 ms,
steadily.

Which steps: one chunk, not streamed, past tokens already in the pool (``start > 0``), of at most
``MAX_T`` tokens, with ``start + bucket(T) <= MAX_KEYS``, on CUDA in fp16/bf16, without sparse
attention. Every other step, and any step whose capture fails, runs eagerly (``ModelRunner.run``).

Key: ``(start, Tp)`` with ``Tp = bucket(T)`` (16, 32, 64, then multiples of 64). The inputs are
padded to Tp rows and the keys are the sequence's first ``start + Tp`` positions, read from the
pool. Flash's causal mask is bottom-right aligned: query i sees keys up to ``tk - tq + i = start +
i``, which is right for the real rows, and they never see a padded position. Padded rows repeat the
last real row's K/V write (same slot, same bytes) and their outputs are dropped; the table pads with
the sequence's first block (read, never seen by a real row). With ``T == Tp`` the graph runs the
kernels of the eager step on the same shapes: logits and K/V are bit-identical. With ``T < Tp`` the
GEMMs and the attention run on Tp rows: equal within bf16 rounding (kernel choice by shape).

Policy: a key is captured the second time it is seen; its first step runs eagerly, so a one-off
shape (a multi-turn chat's cached length, say) costs nothing. The capture step runs the graph's
forward once on the capture stream (warm-up, and the step's result), then captures it. At most
``MAX_GRAPHS`` graphs are kept (least recently used dropped). They share one memory pool: they are
replayed one at a time on one stream and each output is copied out at once, so one graph's
replay never overwrites what another still needs. The pool holds about the largest graph's
activations (the gathered K/V of one layer dominates: ``(start + Tp) * 2 * H * D`` elements).
A graph reads the weights and the pool where they were at capture: if they move (``model.to``),
the graphs are dropped. ``PREFILL_CUDA_GRAPHS=0`` in the environment turns graphs off.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict

import torch

from prefill_server.layers.attention import dense_attention

log = logging.getLogger(__name__)

NOT_RUN = object()  # StepGraphs.run's answer when the caller must run the step eagerly


def bucket(t: int) -> int:
    """Rows a step of t tokens is padded to: 16, 32, 64, then the next multiple of 64."""
    if t <= 64:
        return max(16, 1 << (t - 1).bit_length())
    return -(-t // 64) * 64


class _StepAttention:
    """``attn(layer, q, k, v)`` of a graph's forward, over its static buffers."""

    def __init__(self, g: "_StepGraph"):
        self.g = g

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = self.g
        # padded rows write the last real row's K/V to its slot again (same bytes)
        g.pool.write(layer, g.blocks, g.offsets, k.index_select(0, g.rows), v.index_select(0, g.rows))
        ks, vs = g.pool.read(layer, None, g.num_keys, table=g.table)
        return dense_attention(q, ks.to(q.dtype), vs.to(q.dtype), g.scale)


class _StepGraph:
    """Static inputs of key (start, tp), one int64 buffer on the device: ids, positions, K/V
    slots (block, offset), the row each row writes, the block table, the logits row."""

    def __init__(self, runner, start: int, tp: int):
        self.pool, self.model, self.scale = runner.pool, runner.model, runner.scale
        self.start, self.tp = start, tp
        self.num_keys = start + tp
        self.nb = self.pool.blocks_needed(self.num_keys)
        self.sizes = [tp] * 5 + [self.nb, 1]
        self.inp = torch.zeros(sum(self.sizes), dtype=torch.long, device=self.pool.device)
        self.ids, self.pos, self.blocks, self.offsets, self.rows, self.table, self.last = self.inp.split(self.sizes)
        self.attn = _StepAttention(self)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def load(self, c) -> None:
        """The chunk's inputs: built on the host, one (pinned, asynchronous) copy to the device."""
        s, t, tp, bs = c.start, c.end - c.start, self.tp, self.pool.block_size
        need = self.pool.blocks_needed(c.end)
        cuda = self.inp.is_cuda
        host = torch.empty(self.inp.shape, dtype=torch.long, pin_memory=cuda)
        ids, pos, blocks, offsets, rows, table, last = host.split(self.sizes)
        ids[:t] = torch.tensor(c.seq.request.prompt_token_ids[s:c.end], dtype=torch.long)
        ids[t:] = ids[t - 1]
        torch.arange(s, s + tp, out=pos)
        torch.arange(tp, out=rows)
        rows.clamp_(max=t - 1)
        table[:need] = torch.tensor(c.seq.block_ids[:need], dtype=torch.long)
        table[need:] = table[0]
        rpos = rows + s  # the position whose slot each row writes
        blocks.copy_(table[rpos // bs])
        offsets.copy_(rpos % bs)
        last.fill_(t - 1)
        self.inp.copy_(host, non_blocking=cuda)  # (the host allocator keeps the block until it is done)

    def forward(self) -> torch.Tensor:
        return self.model(self.ids, self.pos, self.attn, self.last)  # [1, V] float32

    def replay(self) -> torch.Tensor:
        if self.graph is None:  # (not captured: StepGraphs(capture=False), the CPU tests)
            return self.forward()
        self.graph.replay()
        return self.out.clone()


class StepGraphs:
    MAX_T = 512  # rows of a step (past it the GPU's time dominates the launch time)
    MAX_KEYS = 32768 + 512  # start + Tp (past it the attention's GPU time dominates)
    MAX_GRAPHS = 8
    CAPTURE_AFTER = 2  # sightings of a key before it is captured
    MAX_FAILURES = 3  # failed captures before graphs are off for this runner

    def __init__(self, runner, capture: bool = True):
        """capture=False: the graphs' forwards run eagerly (tests the padding and policy off CUDA)."""
        self.runner, self.pool, self.capture = runner, runner.pool, capture
        self.graphs: OrderedDict[tuple[int, int], _StepGraph] = OrderedDict()
        self.seen: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.failed: set[tuple[int, int]] = set()
        self.disabled = False
        self.stats = {"replays": 0, "captures": 0, "capture_failures": 0, "evictions": 0, "eager_first": 0,
                      "capture_s": 0.0}
        self._stream: torch.cuda.Stream | None = None
        self._mempool = None  # shared by all graphs
        self._captured_on = None
        params = list(runner.model.parameters())  # (once: ``model.to`` moves their data, not them)
        self._watched = (params[0], params[-1]) if params else ()

    def _fingerprint(self) -> tuple[int, ...]:
        """Where the memory a graph reads lives: the pool and the first and last weights (every step
        with graphs: kept to a few pointer reads)."""
        return (self.pool.kv.data_ptr(), *(p.data_ptr() for p in self._watched))

    @staticmethod
    def wanted(device: torch.device, dtype: torch.dtype) -> bool:
        return (torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
                and os.environ.get("PREFILL_CUDA_GRAPHS", "1") != "0")

    def key(self, chunks) -> tuple[int, int] | None:
        """(start, Tp) if the step can run as a graph, else None."""
        if self.disabled or len(chunks) != 1 or self.runner.sparse is not None:
            return None
        c = chunks[0]
        t = c.end - c.start
        if c.seq.streams or c.start <= 0 or not 0 < t <= self.MAX_T:
            return None
        tp = bucket(t)
        if c.start + tp > self.MAX_KEYS or len(c.seq.block_ids) < self.pool.blocks_needed(c.end):
            return None
        return c.start, tp

    def run(self, chunks):
        """The step's logits (None if its chunk does not end the prompt) from a graph, or NOT_RUN."""
        key = self.key(chunks)
        if key is None:
            return NOT_RUN
        c = chunks[0]
        if self.graphs and self._fingerprint() != self._captured_on:
            self.clear()  # weights or pool moved (model.to, say): the graphs point at freed memory
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            g.load(c)
            out = g.replay()
            self.stats["replays"] += 1
            return out if c.is_last else None
        if key in self.failed:
            return NOT_RUN
        n = self.seen.pop(key, 0) + 1
        self.seen[key] = n
        while len(self.seen) > 4096:
            self.seen.popitem(last=False)
        if n < self.CAPTURE_AFTER:
            self.stats["eager_first"] += 1
            return NOT_RUN
        out = self._build(key, c)
        if out is NOT_RUN:
            return NOT_RUN
        return out if c.is_last else None

    def _build(self, key: tuple[int, int], c):
        t0 = time.monotonic()
        try:
            g = _StepGraph(self.runner, *key)
            g.load(c)
            out = self._capture(g) if self.capture else g.forward()
        except Exception as e:  # any failure: this step (and this key) eagerly
            self.failed.add(key)
            self.stats["capture_failures"] += 1
            self._stream = None
            if self.stats["capture_failures"] >= self.MAX_FAILURES:
                self.disabled = True
            log.warning("CUDA graph capture of a %d-row step over %d cached tokens failed (%r): eager%s",
                        key[1], key[0], e, "; graphs off" if self.disabled else "")
            return NOT_RUN
        self.seen.pop(key, None)
        self._captured_on = self._fingerprint()
        self.graphs[key] = g
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.monotonic() - t0
        while len(self.graphs) > self.MAX_GRAPHS:
            self.graphs.popitem(last=False)
            self.stats["evictions"] += 1
        return out

    def _capture(self, g: _StepGraph) -> torch.Tensor:
        """Warm-up forward on the capture stream (this step's result), then the capture."""
        cur = torch.cuda.current_stream(self.pool.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.pool.device)
        s = self._stream
        s.wait_stream(cur)  # (the inputs' copy)
        try:
            with torch.cuda.stream(s):
                out = g.forward()
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self._mempool, capture_error_mode="thread_local")
                try:
                    g.out = g.forward()
                finally:
                    graph.capture_end()  # (raises if the capture broke)
        finally:
            cur.wait_stream(s)
        out.record_stream(cur)
        if self._mempool is None:
            self._mempool = graph.pool()
        g.graph = graph
        return out

    def clear(self) -> None:
        """Drop every graph (their memory goes back to the caching allocator)."""
        self.graphs.clear()
        self.seen.clear()
        self._mempool = None
