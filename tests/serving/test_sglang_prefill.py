"""The fields of SGLang's PD protocol in a request (``serving/sglang_prefill.py``) and the
--decode-engine sglang settings: every bad value is refused with what to change."""
from __future__ import annotations

import pytest

from prefill_server.config import ServerConfig, SGLangConfig, PoolConfig
from prefill_server.errors import InvalidRequest
from prefill_server.serving import sglang_prefill as sp
from prefill_server.serving.sglang_prefill import requested_logprobs, room_of


def test_a_request_without_a_room_is_not_an_sglang_one():
    assert room_of({"prompt": "hi"}, 8998) is None
    assert room_of({"prompt": "hi"}, None) is None


def test_a_room_is_taken_with_our_bootstrap_port_or_none():
    assert room_of({"bootstrap_room": 7, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998}, 8998) == 7
    assert room_of({"bootstrap_room": 2**63 - 1}, 8998) == 2**63 - 1
    assert room_of({"bootstrap_room": 5, "bootstrap_port": 1234}, 0) == 5  # (ours is any free port: not checked)


@pytest.mark.parametrize("raw, words", [
    ({"bootstrap_room": 0}, "1..2^63-1"),
    ({"bootstrap_room": -3}, "1..2^63-1"),
    ({"bootstrap_room": 2**63}, "1..2^63-1"),
    ({"bootstrap_room": "12"}, "integer"),
    ({"bootstrap_room": True}, "integer"),
    ({"bootstrap_room": 1.5}, "integer"),
    ({"bootstrap_room": [1, 2]}, "one prompt per request"),
    ({"bootstrap_room": 9, "bootstrap_port": 9000}, "--prefill <this server's URL> 8998"),
    ({"bootstrap_room": 9, "bootstrap_port": "8998"}, "bootstrap port"),
    ({"bootstrap_host": "10.0.0.1"}, "without 'bootstrap_room'"),
    ({"bootstrap_port": 8998}, "without 'bootstrap_room'"),
])
def test_bad_rooms_are_refused_with_what_to_change(raw, words):
    with pytest.raises(InvalidRequest, match=words.replace("^", r"\^").replace(".", r"\.").replace("<", "<")):
        room_of(raw, 8998)


def test_a_room_sent_to_a_server_for_vllm_decodes_names_the_flag():
    with pytest.raises(InvalidRequest, match="--decode-engine sglang") as e:
        room_of({"bootstrap_room": 7}, None)
    assert e.value.field == "bootstrap_room"


def test_requested_logprobs():
    c, chat, gen = "/v1/completions", "/v1/chat/completions", "/generate"
    assert requested_logprobs(c, {"logprobs": 3}) == 3
    assert requested_logprobs(c, {"logprobs": 0}) == 0
    assert requested_logprobs(c, {}) is None
    assert requested_logprobs(c, {"logprobs": True}) is None
    assert requested_logprobs(chat, {"logprobs": True, "top_logprobs": 2}) == 2
    assert requested_logprobs(chat, {"logprobs": True}) == 0
    assert requested_logprobs(chat, {"logprobs": False, "top_logprobs": 2}) is None
    assert requested_logprobs(gen, {"return_logprob": True, "top_logprobs_num": 4}) == 4
    assert requested_logprobs(gen, {"return_logprob": False, "top_logprobs_num": 4}) is None


@pytest.mark.parametrize("cfg, words", [
    (ServerConfig(decode_engine="sgl"), "--decode-engine must be one of"),
    (ServerConfig(decode_engine="sglang", transfer_mode="local"), "--transfer-mode local"),
    (ServerConfig(decode_engine="sglang", first_token="prefill"), "leave --first-token auto"),
    (ServerConfig(decode_engine="sglang", pool=PoolConfig(workers=2)), "drop --workers"),
    (ServerConfig(decode_engine="sglang", decode_urls=("http://h:1",), tokenizer_parity="decode"),
     "use refuse or warn"),
    (ServerConfig(decode_engine="sglang", port=8998), "--bootstrap-port must differ"),
    (ServerConfig(decode_engine="sglang", sglang=SGLangConfig(page_size=0)), "--page-size"),
    (ServerConfig(decode_engine="sglang", sglang=SGLangConfig(bootstrap_port=70000)), "--bootstrap-port"),
    (ServerConfig(decode_engine="sglang", sglang=SGLangConfig(transfer_timeout_s=0)), "--sglang-transfer-timeout"),
])
def test_sglang_settings_are_checked(cfg, words):
    with pytest.raises(ValueError, match=words):
        cfg.validate()


def test_sglang_defaults_validate():
    ServerConfig(decode_engine="sglang").validate()
    ServerConfig(decode_engine="sglang", decode_urls=("http://h:1",)).validate()


def test_generate_sampling_is_what_our_first_token_is_drawn_with():
    """/generate's sampling_params as SGLang's sampler takes them: min_new_tokens bans the stop tokens
    from our first token (its min-new-tokens penalizer: stop_token_ids and the end tokens), min_p and
    logit_bias (added as sent) apply, the repetition penalty counts output tokens only (none yet);
    what we do not apply, and token ids outside the vocabulary, are refused."""
    g = sp.parse_generate({"text": "Hi", "sampling_params": {
        "min_new_tokens": 2, "max_new_tokens": 4, "stop_token_ids": [7, 3], "temperature": 0, "min_p": 0.1,
        "repetition_penalty": 1.3, "logit_bias": {"4": 150, "04": -1}}}, (2,), 10)
    s = g.sampling
    assert (s.banned_token_ids, s.temperature, s.min_p, s.repetition_penalty) == ((2, 3, 7), 0, 0.1, 1.0)
    assert s.sampler == "sglang"
    assert s.logit_bias == ((4, -1.0),)  # (equal keys: the last wins, as in SGLang)
    none = sp.parse_generate({"text": "Hi", "sampling_params": {"min_new_tokens": 0}}, (2,), 10)
    assert none.sampling.banned_token_ids == ()
    for bad, field in [({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
                       ({"min_new_tokens": -1}, "min_new_tokens"), ({"min_new_tokens": "2"}, "min_new_tokens"),
                       ({"min_new_tokens": 1, "stop_token_ids": "7"}, "stop_token_ids"),
                       ({"stop_token_ids": [10]}, "stop_token_ids"), ({"logit_bias": {"12": 1}}, "logit_bias"),
                       ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 2.5}, "repetition_penalty"),
                       ({"regex": "[a-z]+"}, "regex"),
                       ({"min_new_tokens": 1, "stop_token_ids": list(range(10))}, "stop_token_ids")]:
        with pytest.raises(InvalidRequest) as e:
            sp.parse_generate({"text": "Hi", "sampling_params": bad}, (2,), 10)
        assert e.value.field == f"sampling_params.{field}"
    sp.check_sampling({"min_tokens": 3, "presence_penalty": 0.5, "min_p": 0.2, "repetition_penalty": 1.2})
    for field, value in (("allowed_token_ids", [1, 2]), ("bad_words", ["x"])):
        with pytest.raises(InvalidRequest, match=field):  # (SGLang's decode would ignore it after our token)
            sp.check_sampling({field: value})
