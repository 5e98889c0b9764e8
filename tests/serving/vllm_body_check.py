"""Run vLLM 0.32's own request validation (in .venv-vllm, never imported by our tests).

    .venv-vllm/bin/python tests/serving/vllm_body_check.py < cases.json
        stdin: a JSON list of {"endpoint": "completion" | "chat", "body": an OpenAI request body};
        stdout: a JSON list of {"ok": bool, "error": str}: whether vLLM's request class
        (``CompletionRequest`` / ``ChatCompletionRequest``, its validators) and the
        ``SamplingParams`` it builds (``to_sampling_params``, whose ``_verify_args`` checks the ranges)
        accept the body, as its serving layer does before a request is scheduled. The answer's token
        limit is the body's ``max_tokens`` (or ``max_completion_tokens``), else 16: a prompt that
        leaves the context room.
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    out = []
    for case in json.load(sys.stdin):
        body = case["body"]
        cls = ChatCompletionRequest if case["endpoint"] == "chat" else CompletionRequest
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        try:
            cls.model_validate(body).to_sampling_params(max_tokens=limit, default_sampling_params={})
            out.append({"ok": True, "error": ""})
        except Exception as e:  # noqa: BLE001 (any refusal is the answer)
            out.append({"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
