"""Run vLLM 0.32's own serving code (in .venv-vllm, never imported by our tests).

    .venv-vllm/bin/python tests/serving/vllm_serving_reference.py bodies < cases.json
        stdin: a JSON list of {"endpoint": "completion" | "chat", "body": an OpenAI request body};
        stdout: a JSON list of {"ok": bool, "error": str}: whether vLLM's request class
        (``CompletionRequest`` / ``ChatCompletionRequest``, its validators) and the
        ``SamplingParams`` it builds (``to_sampling_params``, whose ``_verify_args`` checks the ranges)
        accept the body, as its serving layer does before a request is scheduled. The answer's token
        limit is the body's ``max_completion_tokens`` (chat), else ``max_tokens`` as the request class
        read them, capped at 16, else 16: a prompt that leaves the context room.
    .venv-vllm/bin/python tests/serving/vllm_serving_reference.py roles < conversations.json
        stdin: a JSON list of conversations (lists of {"role", "content", ...} with string content);
        stdout: each as vLLM's HF renderer hands it to a chat template that does not name the
        ``developer`` role (``_convert_developer_to_system``, then ``_consolidate_system_messages``).
    .venv-vllm/bin/python tests/serving/vllm_serving_reference.py messages < conversations.json
        stdin: a JSON list of conversations as clients send them (text content only);
        stdout: each as vLLM's serving hands it to a string-content template (the request class
        validates the messages, then ``_parse_chat_message_content`` per message and
        ``_postprocess_messages``), or {"error": ...} where vLLM refuses it.
    .venv-vllm/bin/python tests/serving/vllm_serving_reference.py shapes < /dev/null
        stdout: {"completion": ..., "chat": ...}: a non-streamed answer of each kind as vLLM's response
        classes serialize it, every optional field at its default (the keys a client may index).
    .venv-vllm/bin/python tests/serving/vllm_serving_reference.py streams < cases.json
        stdin: a JSON list of {"endpoint": "completion" | "chat", "body": request fields (stream_options,
        ...), "prompt_tokens": n, "texts": one text per generated token, "finish_reason": str};
        stdout: for each, the ``data:`` payloads of the stream vLLM's own generator
        (``completion_stream_generator`` / ``chat_completion_stream_generator``, on a serving object
        with the defaults of ``vllm serve`` and system_fingerprint "fp-ref") sends for an engine
        whose outputs are those tokens, one per step: where usage and system_fingerprint go.

    .venv-vllm/bin/python tests/serving/vllm_serving_reference.py draws < cases.json
        stdin: a JSON list of {"logits": one row, "prompt": token ids, "eos": the end token, "params":
        request fields (temperature, top_p, top_k, min_p, repetition_penalty, logit_bias,
        allowed_token_ids, min_tokens, stop_token_ids, bad_words), "tokenizer": a model folder (for
        bad_words, through vLLM's ``update_from_tokenizer``)}; stdout: for each, what vLLM v1's ``Sampler``
        (its built-in logits processors, ``SamplingMetadata`` as the input batch fills it for a first
        token, ``logprobs_mode="processed_logits"``) draws from: {"greedy": the token or null,
        "logits": the processed row, null where -inf}.

Tests (in our venv) call ``ask(mode, payload)``, which runs this file in .venv-vllm.
"""
from __future__ import annotations

import json
import pathlib
import sys

VLLM_PY = pathlib.Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def ask(mode: str, payload=None):
    """From a test: ``mode``'s answer for ``payload``, computed by vLLM's code in .venv-vllm (the
    test is skipped where scripts/setup.sh has not made it)."""
    import subprocess

    import pytest

    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm (scripts/setup.sh makes it)")
    out = subprocess.run([str(VLLM_PY), __file__, mode], input="" if payload is None else json.dumps(payload),
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def bodies(cases: list[dict]) -> list[dict]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    out = []
    for case in cases:
        body = case["body"]
        cls = ChatCompletionRequest if case["endpoint"] == "chat" else CompletionRequest
        try:
            req = cls.model_validate(body)
            # the serving layer's limit (``get_max_tokens``) from the fields as read; 16 in their place
            limit = getattr(req, "max_completion_tokens", None)
            limit = req.max_tokens if limit is None else limit
            req.to_sampling_params(max_tokens=16 if limit is None else min(limit, 16), default_sampling_params={})
            out.append({"ok": True, "error": ""})
        except Exception as e:  # noqa: BLE001 (any refusal is the answer)
            out.append({"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return out


def roles(conversations: list[list[dict]]) -> list[list[dict]]:
    from vllm.renderers import hf

    out = []
    for conv in conversations:
        if any(m["role"] == "developer" for m in conv):  # (vLLM's condition, with a template without it)
            conv = hf._consolidate_system_messages(hf._convert_developer_to_system(conv))
        out.append(conv)
    return out


class _TextOnly:
    """What vLLM's parsing asks of its multimodal tracker for text-only content: a parser with no
    placeholders, and a model config without prompt embeddings (text is checked against those)."""

    model_config = type("ModelConfig", (), {"enable_prompt_embeds": False})()

    def create_parser(self, mm_processor_kwargs=None):
        return self

    def mm_placeholder_storage(self):
        return {}


def messages(conversations: list[list[dict]]) -> list:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers import chat_utils

    out = []
    for conv in conversations:
        try:
            parsed = []
            for m in ChatCompletionRequest.model_validate({"messages": conv}).messages:
                parsed += chat_utils._parse_chat_message_content(m, _TextOnly(), "string", interleave_strings=False)
            chat_utils._postprocess_messages(parsed)
            out.append([dict(m) for m in parsed])
        except Exception as e:  # noqa: BLE001 (a refusal is the answer)
            out.append({"error": f"{type(e).__name__}: {str(e)[:200]}"})
    return out


def shapes(_=None) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponse,
                                                                  ChatCompletionResponseChoice, ChatMessage)
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    chat = ChatCompletionResponse(model="m", usage=usage, choices=[ChatCompletionResponseChoice(
        index=0, message=ChatMessage(role="assistant", content="hi"), finish_reason="length")])
    completion = CompletionResponse(model="m", usage=usage, choices=[CompletionResponseChoice(
        index=0, text="hi", finish_reason="length")])
    return {"chat": json.loads(chat.model_dump_json()), "completion": json.loads(completion.model_dump_json())}


def streams(cases: list[dict]) -> list[list[str]]:
    import asyncio

    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.outputs import CompletionOutput, RequestOutput

    def serving(cls):  # (its __init__ wants a running engine: the attributes the generators read)
        s = object.__new__(cls)
        s.enable_force_include_usage = s.enable_prompt_tokens_details = s.enable_per_request_metrics = False
        s.enable_log_outputs, s.request_logger, s.system_fingerprint = False, None, "fp-ref"
        s.parser_cls, s._include_reasoning_tokens_details, s.response_role = None, False, "assistant"
        return s

    async def outputs(case, pairs: bool):
        texts, ids = case["texts"], list(range(case["prompt_tokens"]))
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            out = RequestOutput("r", "x", ids, None, [CompletionOutput(
                0, text, [100 + i], None, None, finish_reason=case["finish_reason"] if last else None)], last,
                num_cached_tokens=0)
            yield (0, out) if pairs else out

    async def run(case) -> list[str]:
        body, meta = {"model": "m", **case["body"], "stream": True}, RequestResponseMetadata(request_id="r")
        if case["endpoint"] == "chat":
            req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
            gen = serving(OpenAIServingChat).chat_completion_stream_generator(
                req, outputs(case, False), "chatcmpl-r", "m", [], None, meta)
        else:
            req = CompletionRequest.model_validate({"prompt": [1], **body})
            gen = serving(OpenAIServingCompletion).completion_stream_generator(
                req, [None], outputs(case, True), "cmpl-r", 1, "m", 1, None, meta)
        return [ev.removeprefix("data: ").strip() async for ev in gen]

    return [asyncio.run(run(case)) for case in cases]


def draws(cases: list[dict]) -> list[dict]:
    import math
    from types import SimpleNamespace

    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors
    from vllm.v1.sample.logits_processor.state import BatchUpdateBuilder
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=1))
    out = []
    for case in cases:
        logits = torch.tensor([case["logits"]], dtype=torch.float32)
        vocab, prompt = logits.shape[1], case["prompt"]
        sp = SamplingParams.from_optional(**{"max_tokens": 16, **case["params"]})
        sp.update_from_generation_config({}, eos_token_id=case["eos"])
        if case.get("tokenizer"):
            from vllm.tokenizers.registry import get_tokenizer
            sp.update_from_tokenizer(get_tokenizer(case["tokenizer"]))
        procs = [cls(config, torch.device("cpu"), False) for cls in BUILTIN_LOGITS_PROCESSORS]
        batch = BatchUpdateBuilder(added=[(0, sp, prompt, [])]).get_and_reset(1)
        for proc in procs:
            proc.update_state(batch)
        allowed = None
        if sp.allowed_token_ids:
            allowed = torch.ones(1, vocab, dtype=torch.bool)
            allowed[0, sp.allowed_token_ids] = False
        greedy = sp.temperature < 1e-5
        meta = SamplingMetadata(
            temperature=None if greedy else torch.tensor([sp.temperature]), all_greedy=greedy, all_random=not greedy,
            top_p=None if sp.top_p == 1.0 else torch.tensor([sp.top_p]),
            top_k=None if sp.top_k in (0, -1) else torch.tensor([sp.top_k]), generators={}, max_num_logprobs=-1,
            no_penalties=sp.repetition_penalty == 1.0, prompt_token_ids=torch.tensor([prompt]),
            frequency_penalties=torch.zeros(1), presence_penalties=torch.zeros(1),
            repetition_penalties=torch.tensor([sp.repetition_penalty]), output_token_ids=[[]],
            allowed_token_ids_mask=allowed, logitsprocs=LogitsProcessors(procs),
            bad_words_token_ids={0: sp.bad_words_token_ids} if sp.bad_words_token_ids else {})
        res = Sampler(logprobs_mode="processed_logits")(logits.clone(), meta)
        row = res.logprobs_tensors.logprobs[0].tolist()
        out.append({"greedy": int(res.sampled_token_ids[0, 0]) if greedy else None,
                    "logits": [x if math.isfinite(x) else None for x in row]})
    return out


if __name__ == "__main__":
    mode = {"bodies": bodies, "roles": roles, "messages": messages, "shapes": shapes, "streams": streams,
            "draws": draws}[sys.argv[1]]
    json.dump(mode(None if sys.argv[1] == "shapes" else json.load(sys.stdin)), sys.stdout)
