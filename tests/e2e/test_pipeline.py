"""The whole pipeline against a real vLLM 0.32 decode (unmodified, stock NixlConnector consumer):
our prefill + the decode's 32 greedy tokens must equal the same vLLM serving the prompt alone."""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import httpx
import pytest
import torch

from gateway import GatewayThread
from prompts import Prompt, all_prompts
from prefill_server.local_vllm import VllmDecode, vllm_package_dir, vllm_python

from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.serving.server import build_service

MAX_TOKENS = 32
pytestmark = pytest.mark.e2e


def ask(base_url: str, p: Prompt, model: str | None = None, timeout: float = 600,
        extra: dict | None = None) -> list[tuple[str, float]]:
    """32 greedy tokens for prompt p: [(token, top1 - top2 logprob margin)]. extra: more body fields."""
    r = post_prompt(base_url, p, model, timeout, extra)
    choice = r.json()["choices"][0]
    out = []
    if p.kind == "plain":
        lp = choice["logprobs"]
        for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
            vals = sorted(top.values(), reverse=True) + [-math.inf]
            out.append((tok, vals[0] - vals[1]))
    else:
        for item in choice["logprobs"]["content"]:
            vals = sorted((t["logprob"] for t in item["top_logprobs"]), reverse=True) + [-math.inf]
            out.append((item["token"], vals[0] - vals[1]))
    return out


def post_prompt(base_url: str, p: Prompt, model: str | None = None, timeout: float = 600,
                extra: dict | None = None) -> httpx.Response:
    """The OpenAI request ``ask`` sends (32 greedy tokens, top-2 logprobs); asserts HTTP 200."""
    if p.kind == "plain":
        body = {"prompt": p.text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
        path = "/v1/completions"
    else:
        body = {"messages": p.chat(), "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
                "top_logprobs": 2}
        path = "/v1/chat/completions"
    if model:
        body["model"] = model
    body |= extra or {}
    r = httpx.post(base_url + path, json=body, timeout=timeout)
    assert r.status_code == 200, f"{p.name}: {r.status_code} {r.text[:1000]}"
    return r


# bf16 compares bits, and vLLM's CPU attention kernel rounds differently from torch SDPA (and
# differently again per query chunk and thread count: prefill_server/layers/vllm_cpu_attention.py).
# So in bf16 our prefill runs the decode's kernel with the decode's schedule: 1 OpenMP thread (the
# decode's VLLM_CPU_OMP_THREADS_BIND is one core) and chunks of 2048 tokens (its max_num_batched_tokens).
BF16_DECODE_ARGS = ["--max-num-batched-tokens", "2048"]


def bf16_engine_options() -> dict:
    return dict(token_budget=2048, cpu_attention="vllm", vllm_ops=str(vllm_package_dir()), cpu_threads=1)


def pipeline(decode: VllmDecode, dtype: str, **engine_options) -> GatewayThread:
    opts = dict(token_budget=1024) | engine_options
    svc = build_service(EngineConfig(model=decode.model, dtype=dtype, block_size=0, kv_cache_gib=0.25, **opts),
                        ServerConfig(transfer_mode="nixl-compat", decode_urls=(decode.url,)))
    assert svc.worker.engine.pool.block_size == decode.block_size  # adopted from the decode
    return GatewayThread(svc, decode.url).start()


@pytest.fixture(scope="module")
def fp32_gateway(vllm_decode):
    gw = pipeline(vllm_decode, "float32")
    yield gw
    gw.stop()


def test_prompt_set_is_wide_enough():
    ps = all_prompts()
    assert len(ps) >= 20 and {p.kind for p in ps} == {"plain", "chat"}


def test_fp32_every_prompt_token_identical(vllm_decode, fp32_gateway):
    model = vllm_decode.served_model_name()
    mismatches = []
    for p in all_prompts():
        alone = ask(vllm_decode.url, p, model)
        ours = ask(fp32_gateway.url, p)
        if [t for t, _ in ours] != [t for t, _ in alone]:
            mismatches.append(p.name)
    assert mismatches == [], f"fp32 pipeline differs from vLLM alone for {mismatches}"
    assert fp32_gateway.wait_pool_empty() == 0, "KV blocks left in the prefill pool"
    metrics = httpx.get(fp32_gateway.url + "/metrics").text
    assert re.search(r"^prefill_server:kv_blocks_in_use 0\.0$", metrics, re.M)


def test_negative_control_corrupted_kv_changes_output(vllm_decode, fp32_gateway):
    """If the decode did not really use our KV, zeroing it would change nothing."""
    p = next(p for p in all_prompts() if p.kind == "plain" and p.approx_tokens >= 150)
    alone = [t for t, _ in ask(vllm_decode.url, p, vllm_decode.served_model_name())]
    producer = fp32_gateway.service.worker.engine.producer
    pool = fp32_gateway.service.worker.engine.pool
    publish = producer.publish

    def corrupting_publish(request_id, block_ids, num_tokens, **kw):
        pool.kv[:, list(block_ids)] = torch.randn_like(pool.kv[:, list(block_ids)])
        return publish(request_id, block_ids, num_tokens, **kw)

    producer.publish = corrupting_publish
    try:
        ours = [t for t, _ in ask(fp32_gateway.url, p)]
    finally:
        producer.publish = publish
        # the corrupted blocks are named in the prefix cache: a later test asking the same prompt
        # would continue from them (test_first_token_from_prefill_answers_like_vllm_alone did)
        assert fp32_gateway.wait_pool_empty() == 0
        fp32_gateway.service.worker.reset_prefix_cache()
    assert ours != alone
    assert fp32_gateway.wait_pool_empty() == 0


def test_bad_input_keeps_serving_and_leaks_nothing(vllm_decode, fp32_gateway):
    url = fp32_gateway.url
    cases = [
        ({"prompt": ""}, 400), ({"prompt": "x", "model": "nope"}, 404), ({"prompt": [1] * 9000}, 400),
        ({"prompt": "x", "max_tokens": "3"}, 400), ({"messages": "hi"}, 400),
    ]
    for body, status in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
    # a request the decode itself refuses (its own validation) frees our KV at once, whether the
    # decode samples the first token (temperature absent) or continues from ours (temperature 0)
    for extra in ({}, {"temperature": 0}):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 100000, **extra},
                       timeout=60)
        assert 400 <= r.status_code < 500, r.text
    r = httpx.post(url + "/v1/completions", content=b"{oops", timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    p = all_prompts()[0]
    assert ask(url, p) == ask(url, p)  # still serving
    assert fp32_gateway.wait_pool_empty() == 0


def test_streaming_matches_non_streaming(vllm_decode, fp32_gateway):
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16,
            "temperature": 0}
    whole = httpx.post(fp32_gateway.url + "/v1/chat/completions", json=body, timeout=300).json()
    text = ""
    with httpx.stream("POST", fp32_gateway.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                import json
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    assert text == whole["choices"][0]["message"]["content"] and text
    assert fp32_gateway.wait_pool_empty() == 0


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def _first_token_count(url: str, who: str) -> float:
    m = re.search(rf'^prefill_server:first_token_total{{sampled_by="{who}"}} (\S+)$',
                  httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_first_token_from_prefill_answers_like_vllm_alone(vllm_decode, fp32_gateway):
    """Greedy requests take t1 from our prefill and the decode continues from prompt + [t1]
    (serving/first_token.py): the client's answer (text, logprobs, usage, finish reason; streamed
    or not) is vLLM alone's. --first-token decode (the decode samples t1) gives the same tokens."""
    model = vllm_decode.served_model_name()
    plain = next(p for p in all_prompts() if p.kind == "plain" and p.approx_tokens >= 150)
    chat = next(p for p in all_prompts() if p.kind == "chat")
    before = _first_token_count(fp32_gateway.url, "prefill")
    for p in (plain, chat):
        alone = post_prompt(vllm_decode.url, p, model).json()
        ours = post_prompt(fp32_gateway.url, p).json()
        a, o = alone["choices"][0], ours["choices"][0]
        assert ours["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
        assert ours["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
        assert o["finish_reason"] == a["finish_reason"]
        if p.kind == "plain":
            assert o["text"] == a["text"]
            for key in ("tokens", "text_offset"):
                assert o["logprobs"][key] == a["logprobs"][key], key
            assert o["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=2e-3)
            assert [list(d) for d in o["logprobs"]["top_logprobs"]] == [list(d) for d in a["logprobs"]["top_logprobs"]]
        else:
            assert o["message"]["content"] == a["message"]["content"]
            strip = lambda c: [(x["token"], x["bytes"], [t["token"] for t in x["top_logprobs"]]) for x in c]
            assert strip(o["logprobs"]["content"]) == strip(a["logprobs"]["content"])
        # streamed, with usage: the same text and counts, every chunk one id
        path = "/v1/completions" if p.kind == "plain" else "/v1/chat/completions"
        body = ({"prompt": p.text} if p.kind == "plain" else {"messages": p.chat()}) | {
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", fp32_gateway.url + path, json=body, timeout=600) as r:
            assert r.status_code == 200
            events = _sse(r)
        assert len({e["id"] for e in events}) == 1
        pieces = [c.get("text") if p.kind == "plain" else c["delta"].get("content")
                  for e in events for c in e["choices"]]
        whole = a["text"] if p.kind == "plain" else a["message"]["content"]
        assert "".join(x or "" for x in pieces) == whole
        assert events[-1]["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
        assert events[-1]["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
    assert _first_token_count(fp32_gateway.url, "prefill") == before + 4
    svc = fp32_gateway.service
    svc.first_token = "decode"
    try:
        before = _first_token_count(fp32_gateway.url, "decode")
        assert [t for t, _ in ask(fp32_gateway.url, plain)] == [t for t, _ in ask(vllm_decode.url, plain, model)]
        assert _first_token_count(fp32_gateway.url, "decode") == before + 1
    finally:
        svc.first_token = "prefill"
    assert fp32_gateway.wait_pool_empty() == 0


def test_cli_serve_prints_address_and_serves(vllm_decode, tmp_path):
    """The CLI contract other tests and users drive: one line with the address when ready."""
    exe = pathlib.Path(sys.executable).parent / "prefill-server"
    cmd = [str(exe), "serve", "--model", vllm_decode.model, "--port", "0", "--decode-url", vllm_decode.url,
           "--transfer-mode", "nixl-compat", "--dtype", "float32", "--kv-cache-gib", "0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.log", "wb"), text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"listening on (http://\S+)", line)
        assert m, f"no address line: {line!r}; log: {(tmp_path / 'serve.log').read_text()[-2000:]}"
        p = next(p for p in all_prompts() if p.kind == "chat")
        assert [t for t, _ in ask(m.group(1), p)] == [t for t, _ in ask(vllm_decode.url, p)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def compare(alone: list[tuple[str, float]], ours: list[tuple[str, float]]) -> dict:
    """Two answers of ``ask`` side by side: their first tokens and where they part, with each side's
    top1 - top2 logprob margin there (a near tie flips under any rounding)."""
    a, o = [t for t, _ in alone], [t for t, _ in ours]
    i = next((i for i, (x, y) in enumerate(zip(a, o)) if x != y), None)
    return {"first_token_alone": a[0], "first_token_ours": o[0], "first_equal": a[0] == o[0],
            "first_margin_alone": alone[0][1], "first_margin_ours": ours[0][1],
            "identical": i is None, "diverges_at": i,
            "margin_alone": None if i is None else alone[i][1],
            "margin_ours": None if i is None else ours[i][1]}


def check_bf16(decode: VllmDecode, gw: GatewayThread, report_path: pathlib.Path) -> None:
    """The foundation's bf16 criterion: every first token equal, >= 90% of the 32-token sequences
    equal, each divergence at a near-tie (top1 - top2 logprob margin reported). Writes a JSON report."""
    model = decode.served_model_name()
    rows = [{"prompt": p.name, **compare(ask(decode.url, p, model), ask(gw.url, p))} for p in all_prompts()]
    report = {"identical": sum(r["identical"] for r in rows), "prompts": len(rows), "rows": rows}
    report_path.write_text(json.dumps(report, indent=1))
    print(f"\nbf16: {report['identical']}/{len(rows)} sequences identical (report: {report_path})")
    for r in rows:
        if not r["identical"]:
            print("  {prompt} @{diverges_at}: top1-top2 logprob margin {margin_alone:.4f} (vLLM "
                  "alone) / {margin_ours:.4f} (ours)".format(**r))
    first_bad = [r for r in rows if r["first_token_alone"] != r["first_token_ours"]]
    assert first_bad == [], f"first token differs: {first_bad}"
    assert report["identical"] >= math.ceil(0.9 * len(rows))
    for r in rows:  # each divergence sits at a near-tie
        if not r["identical"]:
            assert min(r["margin_alone"], r["margin_ours"]) < 0.25, r
    assert gw.wait_pool_empty() == 0


def report_dir(fallback: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(os.environ.get("PREFILL_E2E_LOG_DIR") or fallback)


@pytest.mark.skipif(vllm_python() is None and os.environ.get("PREFILL_E2E_REQUIRED") != "1",
                    reason="no .venv-vllm")
def test_bf16_first_tokens_match_and_divergences_are_near_ties(decode_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-bf16") / "vllm-decode.log"
    threads = torch.get_num_threads()
    with VllmDecode(model=str(decode_model_dir), log_path=log, dtype="bfloat16", block_size=32,
                    extra_args=BF16_DECODE_ARGS) as decode:
        decode.completion("Warm up.", max_tokens=2)
        gw = pipeline(decode, "bfloat16", **bf16_engine_options())
        try:
            check_bf16(decode, gw, report_dir(log.parent) / "bf16_report_nixl_compat.json")
        finally:
            gw.stop()
            torch.set_num_threads(threads)
