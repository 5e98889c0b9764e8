"""Prefill over gRPC, then let a vLLM decode continue from our KV, streaming its answer.

Start a vLLM decode that reads KV with the stock NixlConnector, and the prefill server pointed at it:

    .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --port 8100 \\
        --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
    prefill-server serve --model MODEL_DIR --decode-url http://127.0.0.1:8100 --grpc-port 50051

then:

    python examples/grpc_pipeline.py --decode-url http://127.0.0.1:8100 "The sea is"
    python examples/grpc_pipeline.py --decode-url http://127.0.0.1:8100 --chat "Write one sentence about the sea."

A plain prompt is continued as text (an instruction model may end an instruction at once: give
it the start of the answer, or use --chat).

Without --decode-url (or against a server in transfer mode "local") it prints the first token only.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from prefill_server.client import AsyncPrefillClient, PrefillClient, PrefillRpcError, astream_completion, \
    stream_completion


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default="The sea is")
    ap.add_argument("--grpc", default="127.0.0.1:50051", help="the prefill server's gRPC address")
    ap.add_argument("--decode-url", default=None, help="the vLLM decode's base URL, e.g. http://127.0.0.1:8100")
    ap.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--api-key", default=None, help="the server's --api-key")
    ap.add_argument("--tls-ca", default=None, help="PEM file of the CA that signed the server's certificate")
    ap.add_argument("--asyncio", action="store_true", help="use the asyncio client")
    args = ap.parse_args(argv)
    ca = open(args.tls_ca, "rb").read() if args.tls_ca else None
    prompt, messages = (None, [{"role": "user", "content": args.prompt}]) if args.chat else (args.prompt, None)
    client_kw = {"api_key": args.api_key, "root_certificates": ca, "timeout": 600}
    try:
        if args.asyncio:
            return asyncio.run(_run_async(args, prompt, messages, client_kw))
        with PrefillClient(args.grpc, **client_kw) as client:
            info = client.server_info(timeout=10)
            print(f"# prefill server: model {info.model}, {info.num_layers} layers, "
                  f"{info.num_kv_heads} KV heads x {info.head_dim}, block {info.block_size}", file=sys.stderr)
            if not args.decode_url:
                r = client.prefill(prompt, messages=messages, temperature=args.temperature)
                client.release(r.request_id)
                print(f"first token: {r.first_token_text!r} ({r.prompt_tokens} prompt tokens, "
                      f"{r.timings['total_s'] * 1000:.0f} ms)")
                return 0
            t0 = time.monotonic()
            for text in stream_completion(client, args.decode_url, prompt, messages=messages,
                                          max_tokens=args.max_tokens, temperature=args.temperature):
                print(text, end="", flush=True)
            print(f"\n# {time.monotonic() - t0:.2f} s", file=sys.stderr)
        return 0
    except PrefillRpcError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


async def _run_async(args, prompt, messages, client_kw) -> int:
    async with AsyncPrefillClient(args.grpc, **client_kw) as client:
        if not args.decode_url:
            r = await client.prefill(prompt, messages=messages, temperature=args.temperature)
            await client.release(r.request_id)
            print(f"first token: {r.first_token_text!r}")
            return 0
        async for text in astream_completion(client, args.decode_url, prompt, messages=messages,
                                             max_tokens=args.max_tokens, temperature=args.temperature):
            print(text, end="", flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
