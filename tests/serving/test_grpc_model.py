"""gRPC on the real embedded model (SmolLM2-135M, local mode), beside the HTTP gateway on the same
service: both front ends give the same first token for the same prompt."""
import pytest
from fastapi.testclient import TestClient
from grpc_harness import GrpcHarness

from prefill_server.client import PrefillClient
from prefill_server.serving.http import create_app
from prefill_server.serving.pb import prefill_pb2 as pb


@pytest.fixture(scope="module")
def grpc_client(local_service):
    h = GrpcHarness(local_service, own_engine=False)  # the session fixture owns the engine
    try:
        with PrefillClient(h.target, timeout=120) as c:
            yield c
    finally:
        h.close()
    assert local_service.worker.engine.pool.num_used == 0


def test_text_and_chat_match_the_http_gateway(grpc_client, local_service):
    r = grpc_client.prefill("The capital of France is", return_prompt_token_ids=True)
    grpc_client.release(r.request_id)
    assert "Paris" in r.first_token_text
    assert r.prompt_token_ids == local_service.tokenizer.encode("The capital of France is")
    chat = [{"role": "user", "content": "Hi! Who are you?"}]
    c = grpc_client.prefill(messages=chat, return_prompt_token_ids=True)
    grpc_client.release(c.request_id)
    assert c.prompt_token_ids == local_service.encode_chat(chat)
    with TestClient(create_app(local_service, None)) as http:
        a = http.post("/v1/completions", json={"prompt": "The capital of France is", "temperature": 0}).json()
        b = http.post("/v1/chat/completions", json={"messages": chat, "temperature": 0}).json()
    assert a["choices"][0]["text"] == r.first_token_text
    assert b["choices"][0]["message"]["content"] == c.first_token_text
    assert b["usage"]["prompt_tokens"] == c.prompt_tokens


def test_a_tool_use_chat_as_chat_json_is_the_prompt_http_renders(grpc_client, local_service):
    """chat_json: an OpenAI chat body with tools, an assistant's tool call, its reasoning and a
    tool's answer prefills the prompt POST /v1/chat/completions renders for the same body."""
    body = {"messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "ipython", "content": "noted"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        "chat_template_kwargs": {"enable_thinking": False}}
    r = grpc_client.prefill(chat=body, return_prompt_token_ids=True)
    grpc_client.release(r.request_id)
    with TestClient(create_app(local_service, None)) as http:
        a = http.post("/v1/chat/completions", json={**body, "temperature": 0, "max_tokens": 1}).json()
    assert a["usage"]["prompt_tokens"] == r.prompt_tokens == len(r.prompt_token_ids)
    assert a["choices"][0]["message"]["content"] == r.first_token_text


def test_server_info_describes_the_model(grpc_client, local_service):
    info = grpc_client.server_info()
    i = local_service.info
    assert (info.model, info.num_layers, info.num_kv_heads, info.head_dim, info.vocab_size) == \
        (i.served_name, i.num_layers, i.num_kv_heads, i.head_dim, i.vocab_size)
    assert info.block_size == 16 and info.kv_dtype == "float32" and info.kv_layout == "LBHNC"
    assert list(info.supported_transfer_modes) == [pb.TRANSFER_MODE_LOCAL]
    assert info.num_free_kv_blocks == info.num_kv_blocks == 64


def test_streamed_prefill_of_a_chunked_prompt(grpc_client, local_service):
    ids = local_service.tokenizer.encode("Once upon a time, " * 55)  # > 256-token budget: chunks
    assert len(ids) > 256
    events = list(grpc_client.prefill_stream(ids))
    assert [e.kind for e in events][:2] == ["queued", "started"] and events[-1].kind == "result"
    assert [e.tokens_done for e in events if e.kind == "progress"][-1] == len(ids)
    assert events[-1].result.prompt_tokens == len(ids)
    grpc_client.release(events[-1].result.request_id)
