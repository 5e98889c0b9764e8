"""A stand-in SGLang 0.5.23 *decode* HTTP server, for e2e tests of this server behind ``sglang-router
--pd-disaggregation``.

SGLang has no CPU build that runs here, so its decode server cannot be started. This server plays that
decode instead. The KV transfer is SGLang's own: ``NixlKVManager`` and ``NixlKVReceiver`` running in
``.venv-sglang`` (``tests/kv_transfer/test_sglang_harness.py``). Per request the decode looks up the
prefill at ``bootstrap_host:bootstrap_port``, asks for ``bootstrap_room`` into freshly allocated pages,
waits for SUCCESS and reads the KV and aux row (first token = ``output_ids[0]``) it received. It then
decodes greedily with Hugging Face transformers (float32) from that KV. The tokens therefore show whether
the KV is right: they must equal HF's greedy generation over the whole prompt.

Served paths, as sglang-router 0.3.2 calls them:

- ``GET /health``, ``/health_generate``
- ``/server_info`` and ``/get_server_info``: SGLang's own ``build_server_info``
- ``/model_info`` and ``/get_model_info``
- ``/v1/models``
- ``POST /v1/completions``, ``/v1/chat/completions`` and ``/generate`` (``input_ids`` or ``text``),
  each with ``stream`` too

Every answer is greedy (any temperature is ignored). Each answer also carries ``output_ids`` and a
``harness`` dict (the aux row: first token, its logprob, ``cached_tokens``). A FAILED room, or none
within ``transfer_timeout_s``, answers 500 with the reason. ``seen`` keeps every POST body.
"""
from __future__ import annotations

import inspect
import itertools
import json
import pathlib
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "kv_transfer"))
from test_sglang_harness import SGLangDecode, venv_missing  # noqa: E402

__all__ = ["HarnessDecode", "venv_missing"]
SUCCESS, FAILED, WAITING = 4, 0, 2  # SGLang's KVPoll states


class DecodeError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class HarnessDecode:
    """``page_size``: the decode's ``--page-size`` (SGLang's default is 1). ``pages``: the pool's size in pages.
    ``port=0`` picks a free port."""

    def __init__(self, model_dir: str | pathlib.Path, log_path: str | pathlib.Path, page_size: int = 1, port: int = 0,
                 pages: int | None = None, kv_dtype: str = "float32", served_model_name: str | None = None,
                 transfer_timeout_s: float = 120.0, heartbeat_s: float = 2.0):
        self.model_dir, self.log_path = pathlib.Path(model_dir), pathlib.Path(log_path)
        self.page_size, self.port, self.kv_dtype = page_size, port, kv_dtype
        self.pages = pages or -(-4096 // page_size)
        self.served_model_name = served_model_name or str(self.model_dir)
        self.transfer_timeout_s, self.heartbeat_s = transfer_timeout_s, heartbeat_s
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self.config = cfg
        self.layers, self.heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.seen: list[dict[str, Any]] = []
        self.harness: SGLangDecode | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._serving: threading.Thread | None = None
        self._lock = threading.Lock()  # one harness call at a time (pages are taken under it too)
        self._model_lock = threading.Lock()  # one forward at a time; polls of other rooms go on meanwhile
        self._free_pages = list(range(1, self.pages + 1))  # page 0 is SGLang's padding page
        self._free_aux = list(range(32))
        self._ids = itertools.count()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ life
    def start(self) -> HarnessDecode:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.harness = SGLangDecode(self.log_path, heartbeat_s=self.heartbeat_s)
        self.harness.call("decode", name="d", page_size=self.page_size, layers=self.layers, heads=self.heads,
                          head_dim=self.head_dim, dtype=self.kv_dtype, pages=self.pages, aux_rows=len(self._free_aux))
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.server_info = self.harness.call("server_info", timeout_s=240, model_path=str(self.model_dir),
                                             page_size=self.page_size, port=self.port,
                                             max_total_num_tokens=self.pages * self.page_size)["server_info"]
        self.server_info["served_model_name"] = self.served_model_name
        self._serving = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._serving.start()

    def close(self) -> None:
        if self._httpd is not None:
            if self._serving is not None:
                self._httpd.shutdown()  # (waits for serve_forever: only once it runs)
            self._httpd.server_close()
            self._httpd = None
        if self.harness is not None:
            self.harness.close()
            self.harness = None

    def __enter__(self) -> HarnessDecode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, **args: Any) -> dict:
        with self._lock:
            return self.harness.call(op, **args)

    # ------------------------------------------------------------------ GETs
    def model_info(self) -> dict:
        return {"model_path": str(self.model_dir), "served_model_name": self.served_model_name,
                "tokenizer_path": str(self.model_dir), "is_generation": True, "preferred_sampling_params": None,
                "weight_version": "default", "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
                "disaggregation_mode": "decode", "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": self.config.get("model_type"), "architectures": self.config.get("architectures")}

    def models(self) -> dict:
        card = {"id": self.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": self.served_model_name, "max_model_len": self.config.get("max_position_embeddings")}
        return {"object": "list", "data": [card]}

    # ------------------------------------------------------------------ a request
    def receive(self, room: int, host: str, port: int | None, n: int) -> tuple[torch.Tensor, dict]:
        """SGLang's receiver for ``room``: pages for ``n`` tokens, then until SUCCESS; -> KV [L, 2, n, H, D], aux row."""
        ps = self.page_size
        with self._lock:
            if len(self._free_pages) * ps < n or not self._free_aux:
                raise DecodeError(503, f"the harness decode has no room for {n} tokens")
            pages, self._free_pages = self._free_pages[: -(-n // ps)], self._free_pages[-(-n // ps):]
            aux = self._free_aux.pop()
        addr = f"{host}:{port if port is not None else 8998}"  # (SGLang's scheduler: None -> its bootstrap port)
        try:
            out = self._call("request", decode="d", room=room, addr=addr, pages=pages, aux=aux)
            if "refused" in out:
                raise DecodeError(500, f"SGLang's decode refused the prefill at {addr}: {out['refused']}")
            deadline = time.monotonic() + self.transfer_timeout_s
            while (state := self._call("peek", decode="d", room=room))["state"] not in (SUCCESS, FAILED):
                if time.monotonic() > deadline:
                    self._call("abort", decode="d", room=room)
                    raise DecodeError(500, f"room {room}: no KV within {self.transfer_timeout_s} s (state {state})")
                time.sleep(0.005)
            if state["state"] == FAILED:
                raise DecodeError(500, f"room {room}: the KV transfer failed: {state['reason']}")
            path = self.log_path.with_name(f"kv-{room}-{uuid.uuid4().hex[:8]}.bin")
            meta = self._call("read", decode="d", room=room, pages=pages, aux=aux, path=str(path))
            kv = np.fromfile(path, dtype=np.float32).reshape(self.layers, 2, len(pages) * ps, self.heads, self.head_dim)
            path.unlink()
            if meta["room"] != room:  # what SGLang's decode calls metadata corruption
                raise DecodeError(500, f"room {room}: the aux row says bootstrap_room {meta['room']}")
            return torch.from_numpy(kv[:, :, :n].copy()), meta
        finally:
            try:
                self._call("clear", decode="d", room=room)
            except RuntimeError:  # (no receiver was made for it)
                pass
            with self._lock:
                self._free_pages += pages
                self._free_aux.append(aux)

    def generate(self, kv: torch.Tensor, first: int, max_new: int, ignore_eos: bool) -> tuple[list[int], list[float]]:
        """Greedy tokens from the received KV plus the first token (the prefill's); their logprobs (the
        first's is the caller's)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer in range(self.layers):  # [n, H, D] -> [1, H, n, D]
            cache.update(kv[layer, 0].permute(1, 0, 2)[None].contiguous(), kv[layer, 1].permute(1, 0, 2)[None].contiguous(), layer)
        tokens, logprobs = [first], [0.0]
        with self._model_lock, torch.no_grad():
            while len(tokens) < max_new and (ignore_eos or tokens[-1] not in self.eos):
                out = self.model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{self._cache_kw: cache})
                lp = torch.log_softmax(out.logits[0, -1].float(), -1)
                tokens.append(int(lp.argmax()))
                logprobs.append(float(lp[tokens[-1]]))
        return tokens, logprobs

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        if path == "/v1/chat/completions":
            ids = self.tokenizer.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompt = body.get("input_ids") if path == "/generate" else body.get("prompt")
        if prompt is None and path == "/generate":
            prompt = body.get("text")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise DecodeError(400, f"the harness decode takes one prompt (text or token ids), not {json.dumps(prompt)[:80]}")

    def answer(self, path: str, body: dict) -> tuple[dict, list[dict]]:
        """-> (the JSON answer, its SSE chunks for ``stream``)."""
        self.seen.append({"path": path, "body": body})
        room, host, port = body.get("bootstrap_room"), body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(room, int) or not isinstance(host, str):
            raise DecodeError(400, f"the harness decode needs one bootstrap_room and bootstrap_host, got {room!r}, {host!r}")
        ids = self.prompt_ids(path, body)
        sp = (body.get("sampling_params") or {}) if path == "/generate" else body
        max_new = sp.get("max_new_tokens") if path == "/generate" else sp.get("max_completion_tokens") or sp.get("max_tokens")
        max_new = max(1, int(max_new if max_new is not None else 16))
        kv, meta = self.receive(room, host, port, len(ids))
        tokens, lps = self.generate(kv, meta["output_id"], max_new, bool(sp.get("ignore_eos")))
        lps[0] = meta["logprob"]
        finish = {"type": "stop", "matched": tokens[-1]} if tokens[-1] in self.eos and not sp.get("ignore_eos") else \
            {"type": "length", "length": len(tokens)}
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        rid, created = f"harness-{next(self._ids)}", int(time.time())
        harness = {"first_token": meta["output_id"], "first_logprob": meta["logprob"],
                   "cached_tokens": meta["cached_tokens"], "room": room, "kv_tokens": len(ids)}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        pieces = [self.tokenizer.decode(tokens[: i + 1], skip_special_tokens=True) for i in range(len(tokens))]
        deltas = [b[len(a):] for a, b in zip([""] + pieces, pieces)]
        if path == "/generate":
            info = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(tokens),
                    "cached_tokens": meta["cached_tokens"]}
            if body.get("return_logprob"):
                info["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, tokens)]
            chunks = [{"text": pieces[i], "output_ids": tokens[: i + 1], "meta_info": {**info, "completion_tokens": i + 1,
                       "finish_reason": finish if i == len(tokens) - 1 else None}} for i in range(len(tokens))]
            return {"text": text, "output_ids": tokens, "meta_info": info, "harness": harness}, chunks
        reason = "stop" if finish["type"] == "stop" else "length"
        if path == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                              "tool_calls": None}, "logprobs": None, "finish_reason": reason}
            chunks = [{"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.get("model"),
                       "choices": [{"index": 0, "delta": {"content": d} if i else {"role": "assistant", "content": d},
                                    "logprobs": None, "finish_reason": reason if i == len(tokens) - 1 else None}]}
                      for i, d in enumerate(deltas)]
            obj = "chat.completion"
        else:
            lp = None
            if body.get("logprobs") is not None:
                lp = {"tokens": [self.tokenizer.decode([t]) for t in tokens], "token_logprobs": lps, "top_logprobs": None,
                      "text_offset": list(itertools.accumulate([0] + [len(d) for d in deltas[:-1]]))}
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason, "matched_stop": None}
            chunks = [{"id": rid, "object": "text_completion", "created": created, "model": body.get("model"),
                       "choices": [{"index": 0, "text": d, "logprobs": None,
                                    "finish_reason": reason if i == len(tokens) - 1 else None}]}
                      for i, d in enumerate(deltas)]
            obj = "text_completion"
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({"id": rid, "object": chunks[0]["object"], "created": created, "model": body.get("model"),
                           "choices": [], "usage": usage})
        return {"id": rid, "object": obj, "created": created, "model": body.get("model"), "choices": [choice],
                "usage": usage, "output_ids": tokens, "harness": harness}, chunks


def _handler(decode: HarnessDecode) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, payload: Any = None, ctype: str = "application/json") -> None:
            data = b"" if payload is None else payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path in ("/health", "/health_generate", "/ready"):
                return self._send(200)
            table = {"/server_info": lambda: decode.server_info, "/get_server_info": lambda: decode.server_info,
                     "/model_info": decode.model_info, "/get_model_info": decode.model_info, "/v1/models": decode.models}
            if path in table:
                return self._send(200, table[path]())
            self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
                return self._send(404, {"detail": "Not Found"})
            try:
                body = json.loads(raw)
                answer, chunks = decode.answer(path, body)
            except DecodeError as e:
                return self._send(e.status, {"object": "error", "message": str(e), "type": "BadRequestError"
                                             if e.status < 500 else "InternalServerError", "code": e.status})
            except Exception as e:  # noqa: BLE001 - the test reads the reason
                return self._send(500, {"object": "error", "message": f"{type(e).__name__}: {e}",
                                        "type": "InternalServerError", "code": 500})
            if not body.get("stream"):
                return self._send(200, answer)
            sse = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
            self._send(200, sse, "text/event-stream")

    return Handler
