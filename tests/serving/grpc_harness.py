"""A gRPC server over the real Engine / ModelRunner / KVPool / LocalProducer with a tiny torch model
(fast, deterministic, no weights to load), run in a background event loop like ``serve`` does."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import torch
from torch import nn

from prefill_server.backends import LocalBackend
from prefill_server.engine.engine import Engine
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.engine.prefix_cache import salt_of
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.worker import LocalWorker
from prefill_server.layers.attention import dense_attention
from prefill_server.serving.grpc_server import start_grpc
from prefill_server.serving.service import ModelInfo, PrefillService

BOS, USER, ASSISTANT = 256, 257, 258
VOCAB = 260


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; BOS and two role tokens; a one-line chat template."""

    max_token_chars = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def continuation_text(self, context_ids, token_id: int, skip_special_tokens: bool = True) -> str | None:
        before, after = self.decode(context_ids[-6:]), self.decode([*context_ids[-6:], token_id])
        return after[len(before):] if after.startswith(before) and "\ufffd" not in after[len(before):] else None

    def token_string(self, token_id: int) -> str:
        return self.decode([token_id])

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs) -> str:
        """Tools and tool calls (their arguments as the objects vLLM hands templates) rendered too."""
        tools = "".join(f"<tools>{t['function']['name']}\n" for t in kwargs.get("tools") or ())
        calls = lambda m: "".join(f"[{c['function']['name']}{json.dumps(c['function']['arguments'])}]"  # noqa: E731
                                  for c in m.get("tool_calls") or ())
        return tools + "".join(f"<{m['role']}>{m.get('content') or ''}{calls(m)}\n" for m in messages) + "<assistant>"


class TinyLM(nn.Module):
    """Follows the model interface: forward(input_ids [T], positions [T], attn, logits_indices [B])
    -> float32 logits [B, V], calling attn(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])."""

    def __init__(self, vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, max_len=512):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.qkv = nn.ModuleList(nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(heads * head_dim, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.5
        self.delay_s = 0.0  # per forward call: makes requests slow enough to cancel / watch

    @torch.no_grad()
    def forward(self, input_ids, positions, attn, logits_indices=None):
        if self.delay_s:
            time.sleep(self.delay_s)
        x = self.embed(input_ids) + self.pos(positions)  # [T, hidden]
        t, hq, hk, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(x).split([hq * d, hk * d, hk * d], dim=-1)
            out = attn(i, q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d))  # [T, Hq, D]
            x = x + torch.tanh(o(out.reshape(t, hq * d)))
        if logits_indices is not None:
            x = x[logits_indices]
        return self.head(x).float()

    def reference_next_token(self, ids: list[int]) -> int:
        """Greedy next token of a whole prompt computed in one dense pass (no pool, no chunks)."""
        def attn(layer, q, k, v):
            return dense_attention(q, k, v, self.head_dim ** -0.5)
        t = torch.tensor(ids)
        return int(self.forward(t, torch.arange(len(ids)), attn, torch.tensor([len(ids) - 1]))[0].argmax())


def make_service(*, num_blocks=24, block_size=8, token_budget=64, max_queue_wait_s=0.5, max_model_len=256,
                 lease_ttl_s=30.0, prefix_cache=False) -> PrefillService:
    """prefix_cache: the pool caches prompt heads (as serve does by default; off here unless asked)."""
    model = TinyLM().eval()
    salt = salt_of("/models/tiny", "float32", block_size) if prefix_cache else None
    pool = KVPool(len(model.qkv), num_blocks, model.kv_heads, block_size, model.head_dim, torch.float32,
                  cache_salt=salt)
    runner = ModelRunner(model, pool, model.head_dim, torch.device("cpu"))
    engine = Engine(runner, pool, LocalProducer(pool, lease_ttl_s), max_model_len=max_model_len,
                    vocab_size=VOCAB, token_budget=token_budget, max_num_seqs=8,
                    max_queue_wait_s=max_queue_wait_s)
    info = ModelInfo("tiny", "/models/tiny", len(model.qkv), model.kv_heads, model.head_dim, VOCAB,
                     max_model_len, "float32", block_size, prefix_cache=prefix_cache, lease_ttl_s=lease_ttl_s)
    return PrefillService(LocalWorker(engine), ByteTokenizer(), info, LocalBackend())


class GrpcHarness:
    """Engine thread + an event loop thread running start_grpc(service, ...)."""

    def __init__(self, service: PrefillService | None = None, own_engine: bool = True, **grpc_kwargs):
        self.service = service or make_service()
        self.own_engine = own_engine
        self.model = self.service.worker.engine.runner.model
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()
        if own_engine:
            self.service.worker.engine.start()
        self.server = self.run(start_grpc(self.service, "127.0.0.1", 0, **grpc_kwargs))
        self.target = f"127.0.0.1:{self.server.port}"

    def run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def pool(self) -> KVPool:
        return self.service.worker.engine.pool

    def wait_pool_empty(self, timeout=5.0) -> int:
        """Blocks in use once the pool has drained (or the timeout passed)."""
        end = time.monotonic() + timeout
        while self.pool.num_used and time.monotonic() < end:
            time.sleep(0.01)
        return self.pool.num_used

    def close(self) -> None:
        self.run(self.server.stop(0))
        if self.own_engine:
            self.service.worker.engine.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()
