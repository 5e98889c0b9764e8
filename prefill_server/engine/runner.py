"""Model runner: turns a step's chunks into one flattened forward over the paged KV pool.

Tokens of all chunks are concatenated ([T] ids and positions); at every layer the attention context
writes the chunk's K/V into the pool pages, then attends each chunk's queries to its sequence's keys
(earlier chunks read back from the pool, the current chunk's straight from the projection).

A streamed (push) prompt runs alone and whole: at layer l its K/V go to staging slot l % S, the
producer starts that layer's WRITE at once (overlapping the attention and the next layers), and
slot reuse waits for the WRITE of layer l - S. A streamed prompt with a cached head computes only
the rest (attending to the head's K/V read from its pool blocks); its layer l is then sent from
the head blocks' layer-l pages followed by the rest's. With room in the pool (``stream_whole``)
the rest goes into the prompt's own whole blocks instead of staging: no slot to wait for, and
the blocks are cached for later prompts.

Each slice that reads earlier tokens back from the pool has its block table built once per step
(``KVPool.block_table``), not per layer. On CUDA a small step of one chunk past a cached head (a
prefix-cache hit) replays a CUDA graph instead (``graphs.py``): the eager step is bound by the
host's launch time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kv_transfer.base import StreamProducer
from prefill_server.engine.graphs import NOT_RUN, StepGraphs
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.scheduler import Chunk, Scheduler, Sequence
from prefill_server.errors import RequestCancelled
from prefill_server.layers import fp8
from prefill_server.layers.attention import dense_attention


# the kernel's query/key block for FP8 scores (the block-sparse kernel's tiling, dense)
FP8_SCORES_BLOCK = 128


def fp8_scores_wanted(setting: str, pool: KVPool, head_dim: int) -> bool:
    """``--fp8-attention`` (auto: with FP8 pages, as vLLM; on; off) where FP8 scores run: a bf16 / fp16
    model on a device with FP8 tensor cores, and a head_dim the kernel takes (a power of two, 32 to 256:
    FP8 dots need K >= 32). (The codes come from the fused rope pass: without Triton there are none.)"""
    if setting == "off" or (setting == "auto" and not pool.format.quantized):
        return False
    return (fp8.has_fp8_tensor_cores(pool.device) and not head_dim & (head_dim - 1) and 32 <= head_dim <= 256
            and pool.compute_dtype in (torch.bfloat16, torch.float16))


@dataclass
class _SeqSlice:
    q_start: int  # offset of this chunk's tokens in the flattened batch
    q_end: int
    start: int  # prompt positions [start, end) computed now
    end: int
    block_ids: list[int]
    seq: Sequence | None = None


class _Stream:
    """Staging of one streamed prompt: per slot, flat pool pages of the computed rest [m] and per
    token [T]; per layer, the pages the WRITE sends (the cached head's, then the slot's). An abort
    of the sequence (``Engine.abort``) stops the forward at the next layer: nothing more is
    computed or written (the engine then aborts the transfer and frees the staging blocks)."""

    def __init__(self, pool: KVPool, producer, seq: Sequence, num_tokens: int, slots: int):
        self.producer, self.seq, self.request_id, self.slots = producer, seq, seq.request_id, slots
        self.num_cached = seq.num_cached  # whole blocks: the rest starts on a block boundary
        self.whole, nb = seq.stream_whole, pool.num_blocks
        head = self.num_cached // pool.block_size
        self.head_blocks, staging = seq.block_ids[:head], seq.block_ids[head:]
        self.head_table = None
        rest = num_tokens - self.num_cached
        pos = torch.arange(rest)
        self.offsets = (pos % pool.block_size).to(pool.device)
        # the producer keeps each list object until the request ends (descriptors are built per list)
        if self.whole:  # layer l of block b is flat page l * NB + b
            own = seq.block_ids[:pool.blocks_needed(num_tokens)]
            self.token_blocks = torch.tensor(staging, dtype=torch.long)[pos // pool.block_size].to(pool.device)
            self.pages = [[layer * nb + b for b in own] for layer in range(pool.num_layers)]
            return
        slot_pages = [pool.stream_pages(staging, rest, s, slots) for s in range(slots)]
        self.token_pages = [torch.tensor(p, dtype=torch.long)[pos // pool.block_size].to(pool.device)
                            for p in slot_pages]
        self.pages = ([[layer * nb + b for b in self.head_blocks] + slot_pages[layer % slots]
                       for layer in range(pool.num_layers)] if head else slot_pages)

    def _aborted(self) -> bool:
        return self.seq.abort_requested

    def write(self, pool: KVPool, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.seq.abort_requested:
            raise RequestCancelled(f"request {self.request_id} was aborted (at layer {layer})")
        slot = layer % self.slots
        if self.whole:
            pool.write(layer, self.token_blocks, self.offsets, k, v)
        else:
            if layer >= self.slots:
                # the slot's previous WRITE; an abort meanwhile stops the wait at once (Engine.abort)
                self.producer.wait_layer(self.request_id, layer - self.slots, stop=self._aborted)
            pool.write_flat(self.token_pages[slot], self.offsets, k, v)
        event = None
        if k.is_cuda:
            event = torch.cuda.Event()
            event.record()
        per_layer = self.whole or self.head_blocks
        self.producer.layer_done(self.request_id, layer, self.pages[layer if per_layer else slot], event)

    def context(self, pool: KVPool, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the rest's queries attend to: the cached head's (from its pool
        blocks), then the rest's own. k, v: [T, H, D] -> [head + T, H, D]."""
        if not self.head_blocks:
            return k, v
        if self.head_table is None:  # built once for all layers
            self.head_table = pool.block_table(self.head_blocks, self.num_cached)
        hk, hv = pool.read(layer, None, self.num_cached, table=self.head_table)
        return torch.cat([hk.to(k.dtype), k]), torch.cat([hv.to(v.dtype), v])


class PagedAttention:
    """The ``attn(layer, q, k, v)`` callable the model calls at each layer for one step.

    FP8 scores (``fp8_scores``, ``ModelRunner``'s fp8_attention): on CUDA, q and k as e4m3 codes, as
    vLLM's FlashAttention-3 does with an FP8 KV cache (q_scale 1.0, the pages' k_scale), QK^T at the
    FP8 tensor-core rate, ``p @ v`` in the model dtype. A step of prompts that all start in it: one
    launch of our kernel over the packed prompts (a streamed prompt: without a cached head); a layer
    that sparse attention takes, for a prompt alone in its step, through ``SparseAttention.attend``
    with the codes. A step with later chunks (or prefix-cache hits): one launch per chunk over its
    keys read back as codes (FP8 pages' own bytes), dense layers only."""

    def __init__(self, pool: KVPool, slices: list[_SeqSlice], scale: float, sparse=None,
                 stream: _Stream | None = None, fp8_scores: bool = False):
        self.pool, self.slices, self.scale, self.sparse = pool, slices, scale, sparse
        self.stream = stream
        self._fp8 = None  # (q_scale, k_scale) when this step may take FP8 scores
        self._whole = all(s.start == 0 for s in slices)  # every prompt starts in this step
        if fp8_scores and (stream is None or self._whole):  # (not a streamed prompt past a cached head)
            self._fp8, self._layouts = (1.0, pool.format.k_scale), {}
        if stream is None:
            blocks, offsets = zip(*(pool.slot_mapping(s.block_ids, s.start, s.end) for s in slices))
            self.blocks, self.offsets = torch.cat(blocks), torch.cat(offsets)  # [T] each
            # block tables of the slices that read earlier chunks back, once for all layers
            self.tables = [pool.block_table(s.block_ids, s.end) if s.start else None for s in slices]

    def fp8_scores(self, layer: int) -> tuple[float, float] | None:
        """(q_scale, k_scale) when layer ``layer`` takes q and k as e4m3 codes (``__call__``'s k8)."""
        if self._fp8 is None or ((len(self.slices) > 1 or not self._whole) and self._sparse_wants(layer)):
            return None
        return self._fp8

    def _sparse_wants(self, layer: int) -> bool:
        return self.sparse is not None and any(self.sparse.wants(layer, s.end) for s in self.slices)

    def _attend_codes(self, key, q8: torch.Tensor, k8: torch.Tensor, v: torch.Tensor, q_lens: list[int],
                      k_lens: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Our kernel, dense, on e4m3 q8 [Tq, Hq, D] and k8 [Tk, Hkv, D]: the packed sequences of
        these lengths, each query chunk bottom-right causal on its keys -> [Tq, Hq, D] in v's dtype.
        The layout is built once per step (``key``) and kept for the other layers."""
        from prefill_server.kernels.block_sparse import kernel
        from prefill_server.kernels.block_sparse.layout import build_layout

        layout = self._layouts.get(key)
        if layout is None:
            cq, ck = ([0, *itertools.accumulate(n)] for n in (q_lens, k_lens))
            cq, ck = (torch.tensor(c, dtype=torch.int32).to(q8.device) for c in (cq, ck))
            layout = self._layouts[key] = build_layout(cq, ck, q8.shape[0], k8.shape[0], FP8_SCORES_BLOCK)
        qs, ks = self._fp8
        return kernel.attention(q8, k8, v, layout, None, None, self.scale, dense=True, qk_descale=qs * ks,
                                out=out)[0]

    def _attend_fp8(self, layer: int, q8: torch.Tensor, k8: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q8 [T, Hq, D], k8 [T, Hkv, D] e4m3, v [T, Hkv, D] -> o [T, Hq, D]. Whole prompts: one launch
        over the packed step; later chunks: one per chunk, its keys [0, end) read back from the pool as
        codes (this chunk's were written above)."""
        if self._whole:
            lens = [s.end for s in self.slices]
            return self._attend_codes("step", q8, k8, v, lens, lens)
        out = torch.empty(q8.shape, dtype=v.dtype, device=q8.device)
        for i, (s, table) in enumerate(zip(self.slices, self.tables)):
            if s.start == 0:
                kc, vc = k8[s.q_start:s.q_end], v[s.q_start:s.q_end]
            else:
                kc, vc = self.pool.read(layer, s.block_ids, s.end, table=table, k_codes=True)
                vc = vc.to(v.dtype)
            self._attend_codes(i, q8[s.q_start:s.q_end], kc, vc, [s.q_end - s.q_start], [s.end],
                               out=out[s.q_start:s.q_end])
        return out

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k8: torch.Tensor | None = None) -> torch.Tensor:
        # q [T, Hq, D], k/v [T, Hkv, D] -> o [T, Hq, D]; with k8 (fp8_scores): q and k8 e4m3 codes
        if self.stream is None and all(s.seq is not None and s.seq.abort_requested for s in self.slices):
            # every prompt of the step was aborted (a client gone, a Release): stop here, not at the step's
            # end, so that a long step frees its blocks now (a streamed one stops in its write)
            raise RequestCancelled(f"the step's requests were aborted (at layer {layer})")
        if k8 is not None:
            if self.stream is not None:
                self.stream.write(self.pool, layer, k, v)
            else:
                self.pool.write(layer, self.blocks, self.offsets, k, v)
            if self._sparse_wants(layer):  # a prompt alone in its step, whole (fp8_scores)
                qs, ks = self._fp8
                return self.sparse.attend(layer, q, k, v, self.scale, k8=k8, qk_descale=qs * ks)
            return self._attend_fp8(layer, q, k8, v)
        if self.stream is not None:  # one whole prompt (past a cached head): K/V to staging
            self.stream.write(self.pool, layer, k, v)
            ks, vs = self.stream.context(self.pool, layer, k, v)
            if self.sparse is not None and self.sparse.wants(layer, ks.shape[0]):
                return self.sparse.attend(layer, q, ks, vs, self.scale)
            return dense_attention(q, ks, vs, self.scale)
        self.pool.write(layer, self.blocks, self.offsets, k, v)
        if len(self.slices) == 1 and self.slices[0].start == 0 and self.sparse is None:
            return dense_attention(q, k, v, self.scale)  # one whole prompt: no gather, no copy
        out = torch.empty_like(q)
        for s, table in zip(self.slices, self.tables):
            if s.start == 0:
                ks, vs = k[s.q_start:s.q_end], v[s.q_start:s.q_end]
            else:  # earlier chunks live in the pool; read back [0, end)
                ks, vs = self.pool.read(layer, s.block_ids, s.end, table=table)
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)
            qs = q[s.q_start:s.q_end]
            if self.sparse is not None and self.sparse.wants(layer, s.end):
                out[s.q_start:s.q_end] = self.sparse.attend(layer, qs, ks, vs, self.scale)
            else:
                out[s.q_start:s.q_end] = dense_attention(qs, ks, vs, self.scale)
        return out


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, head_dim: int, device: torch.device,
                 sparse=None, stream_to: StreamProducer | None = None, fp8_attention: str = "off"):
        """fp8_attention: ``--fp8-attention`` (auto | on | off): FP8 scores where they run
        (``fp8_scores_wanted``) and ``PagedAttention`` allows them."""
        self.model, self.pool, self.device = model, pool, device
        self.scale = head_dim ** -0.5
        self.fp8_attention = fp8_scores_wanted(fp8_attention, pool, head_dim)
        self.sparse = sparse
        self.stream_to = stream_to  # where STREAM prompts' layers are written (connector mode)
        # small steps of one chunk past a cached head as CUDA graphs (None off CUDA; graphs.py)
        self.graphs = StepGraphs(self) if StepGraphs.wanted(device, pool.dtype) else None

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> torch.Tensor | None:
        """Forward one step; returns float32 logits [n_last, V] for the chunks that end a prompt
        (in chunk order), or None if none does."""
        if self.graphs is not None:
            out = self.graphs.run(chunks)  # a replayed graph, or NOT_RUN: the step as below
            if out is not NOT_RUN:
                return out
        ids, pos, slices, last_rows = [], [], [], []
        t = 0
        for c in chunks:
            n = c.end - c.start
            ids.extend(c.seq.request.prompt_token_ids[c.start:c.end])
            pos.append(torch.arange(c.start, c.end, device=self.device))
            slices.append(_SeqSlice(t, t + n, c.start, c.end, c.seq.block_ids, c.seq))
            t += n
            if c.is_last:
                last_rows.append(t - 1)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.cat(pos)
        stream = None
        if len(chunks) == 1 and chunks[0].seq.streams:
            c = chunks[0]
            assert c.start == c.seq.num_cached and c.is_last, "a streamed prompt runs whole (past its cached head)"
            assert self.stream_to is not None, "a STREAM request on an engine whose producer does not stream"
            stream = _Stream(self.pool, self.stream_to, c.seq, c.end, Scheduler.STREAM_SLOTS)
        attn = PagedAttention(self.pool, slices, self.scale, self.sparse, stream, self.fp8_attention)
        idx = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        logits = self.model(input_ids, positions, attn, idx)  # [n_last, V]; empty rows are cheap
        return logits if last_rows else None
