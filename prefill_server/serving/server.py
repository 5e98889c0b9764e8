"""Assemble and run the server: engine + transfer producer + HTTP gateway (one process)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import socket
import sys

import uvicorn

from kv_transfer.vllm import discovery
from kv_transfer.vllm.discovery import DecodeFacts
from prefill_server.backends import TransferBackend, backend_for, first_token_mode
from prefill_server.config import KV_CACHE_DTYPES, EngineConfig, ServerConfig
from prefill_server.engine.worker import build_local_worker
from prefill_server.serving.grpc_server import start_grpc
from prefill_server.serving.http import create_app
from prefill_server.serving.auth import ApiKeys, load_api_key
from prefill_server.serving.decode_client import DecodeClient
from prefill_server.serving.decodes import Decode, DecodeSet
from prefill_server.serving.service import ModelInfo, PrefillService
from prefill_server.serving.token_parity import ParityOutcome

log = logging.getLogger(__name__)


def build_service(ecfg: EngineConfig, scfg: ServerConfig,
                  fleet: DecodeFacts | tuple[DecodeFacts, ...] | None = None,
                  parity: ParityOutcome | None = None) -> PrefillService:
    """The worker (engine + the transfer mode's producer) and the serving core. ``fleet``: the
    decodes as already discovered (else they are asked here, each waited for up to
    ``scfg.decode_wait_s``, and their tokenizers probed: ``check_tokenizers``). ``parity``: the
    probe's outcome when the caller ran it (none: tokenize here)."""
    if fleet is None:
        scfg = resolve_decode_engine(scfg)
    elif scfg.decode_engine == "auto":  # the facts given say which (SGLang's carry no vLLM version)
        given = (fleet,) if isinstance(fleet, DecodeFacts) else tuple(fleet)
        sglang = bool(given) and all(not f.vllm_version and not f.declared for f in given)
        scfg = dataclasses.replace(scfg, decode_engine="sglang" if sglang else "vllm")
    backend = backend_for(scfg)
    discovered_here = fleet is None
    fleet = discover_fleet(scfg, backend, fleet, ecfg)
    if discovered_here:
        parity = check_tokenizers(ecfg, scfg, fleet)
    ecfg = follow_decode(ecfg, next((f for f in fleet if f.dtype), fleet[0] if fleet else None))
    ecfg = follow_decode_cache(ecfg, scfg, fleet[0] if fleet else None)
    if scfg.pool.enabled:  # workers on Ray (imported only then); started by worker.start()
        from prefill_server.cluster.pool import build_ray_pool

        worker = build_ray_pool(ecfg, scfg, fleet)
    else:
        worker = build_local_worker(ecfg, backend, fleet, side_channel_host=scfg.side_channel_host,
                                    side_channel_port=scfg.side_channel_port)
    m = worker.loaded
    c = m.config
    served = scfg.served_model_name or (fleet[0].served_model_name if fleet else m.path)
    if fleet and not fleet[0].declared and served != fleet[0].served_model_name:
        log.info("clients name the model %r here; requests reach the decodes as their own %r", served,
                 fleet[0].served_model_name)
    source = ("the decode's --max-model-len" if worker.max_model_len < c.max_position_embeddings
              else "the model's context")
    info = ModelInfo(served, m.path, c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size, worker.max_model_len,
                     str(m.dtype).removeprefix("torch."), worker.block_size,
                     max_model_len_source=source, prefix_cache=ecfg.prefix_cache,
                     kv_cache_dtype=ecfg.kv_cache_dtype, lease_ttl_s=ecfg.lease_ttl_s)
    return PrefillService(worker, m.tokenizer, info, backend, first_token=first_token_mode(scfg, backend),
                          eos_token_ids=c.eos_token_ids, parity=parity)


def check_tokenizers(ecfg: EngineConfig, scfg: ServerConfig, fleet: tuple[DecodeFacts, ...]) -> ParityOutcome:
    """Probe each reachable decode's tokenizer against ours and apply --tokenizer-parity
    (``token_parity.py``; raises ``TokenizerMismatch`` to refuse). Runs before the weights load,
    so a refusal comes in seconds."""
    from prefill_server.models.registry import resolve_model
    from prefill_server.models.tokenizer import Tokenizer
    from prefill_server.serving import token_parity
    from prefill_server.serving.decode_tokenizer import DecodeTokenizer

    reachable = [f for f in fleet if not f.declared]
    if scfg.decode_engine == "sglang":
        log.info("tokenizer parity: SGLang decodes serve no POST /tokenize to compare with; they must use this "
                 "server's tokenizer files and chat template (the same --model folder)")
        return ParityOutcome(scfg.tokenizer_parity)
    if not reachable:
        if fleet:  # a prefill instance: the router's decodes are declared, never seen
            log.info("tokenizer parity: no decode to probe (no --decode-url: the PD router's decodes tokenize "
                     "its requests themselves); they must use this server's tokenizer files and chat template")
        return ParityOutcome(scfg.tokenizer_parity)
    path = resolve_model(ecfg.model)
    decodes = [DecodeTokenizer(f.url, f.served_model_name, request_timeout_s=scfg.decode_timeout_s) for f in reachable]
    return token_parity.check_fleet(Tokenizer(path), decodes, scfg.tokenizer_parity, str(path))


def discover_fleet(scfg: ServerConfig, backend: TransferBackend,
                   fleet: DecodeFacts | tuple[DecodeFacts, ...] | None,
                   ecfg: EngineConfig | None = None) -> tuple[DecodeFacts, ...]:
    """The decodes' facts (asked now unless given), checked to take the same KV. Without any
    --decode-url: the facts the user declares for the decodes a PD router will pair us with."""
    if not backend.needs_decode:
        return ()
    if fleet is None:
        if scfg.decode_engine == "sglang":
            from kv_transfer.sglang import discovery as sglang_discovery

            return discovery.wait_for_all(scfg.decode_urls, scfg.decode_wait_s, discover=sglang_discovery.discover)
        if not scfg.decode_urls:
            return (declared_decodes(ecfg or EngineConfig(), scfg),)
        return discovery.wait_for_all(scfg.decode_urls, scfg.decode_wait_s)
    fleet = (fleet,) if isinstance(fleet, DecodeFacts) else tuple(fleet)
    discovery.check_fleet(fleet)
    return fleet


def resolve_decode_engine(scfg: ServerConfig) -> ServerConfig:
    """--decode-engine auto: what the first decode's GET /server_info says it is (waited for up to
    --decode-wait); vLLM without a --decode-url. The settings are checked again for that engine."""
    if scfg.decode_engine != "auto":
        return scfg
    engine = "vllm"
    if scfg.decode_urls and scfg.transfer_mode != "local":
        from kv_transfer.sglang import discovery as sglang_discovery

        def engine_of(url: str, timeout_s: float) -> str:
            return "sglang" if sglang_discovery.is_sglang(sglang_discovery.server_info(url, timeout_s)) else "vllm"

        engine = discovery.wait_for(scfg.decode_urls[0], scfg.decode_wait_s, discover=engine_of)
        log.info("decode %s is %s (its GET /server_info)", scfg.decode_urls[0], "SGLang" if engine == "sglang"
                 else "vLLM")
    scfg = dataclasses.replace(scfg, decode_engine=engine)
    scfg.validate()
    return scfg


def declared_decodes(ecfg: EngineConfig, scfg: ServerConfig) -> DecodeFacts:
    """A prefill instance's decodes as its flags declare them (vLLM's NIXL handshake hashes the
    version, the --model string and the attention backend: a wrong one fails there, so say them)."""
    from prefill_server.models.registry import resolve_model

    nc = scfg.nixl_compat
    model = nc.decode_model or scfg.served_model_name or ecfg.model or str(resolve_model(None))
    on_cpu = ecfg.device == "cpu" or (ecfg.device == "auto" and not discovery.has_gpu())
    backend = nc.decode_attn_backend or (discovery.CPU_BACKEND if on_cpu else "FLASH_ATTN")
    facts = discovery.declared(vllm_version=nc.decode_vllm_version, model=model,
                               served_model_name=scfg.served_model_name or model, attn_backend_name=backend,
                               block_size=ecfg.block_size or None,
                               dtype=None if ecfg.dtype == "auto" else ecfg.dtype, cache_dtype=ecfg.kv_cache_dtype)
    log.info("prefill instance (no --decode-url): serving requests with kv_transfer_params.do_remote_decode "
             "for decodes that run vLLM %s with --model %r and attention backend %s (a decode that differs "
             "fails its NIXL handshake with 'compatibility hash mismatch': set --decode-vllm-version, "
             "--decode-model, --decode-attn-backend)", facts.vllm_version, facts.model, facts.attn_backend_name)
    return facts


def decode_set(fleet: tuple[DecodeFacts, ...], backend: TransferBackend, scfg: ServerConfig, metrics,
               admit=None) -> DecodeSet | None:
    """The decodes this gateway sends requests to (none: a prefill instance behind a router).
    ``admit``: the check a decode that was down passes before it takes requests again."""
    reachable = [f for f in fleet if not f.declared]
    if not reachable:
        return None
    return DecodeSet([Decode(DecodeClient(f.url, scfg.decode_timeout_s), backend.decode_group(f), f.served_model_name)
                      for f in reachable],
                     scfg.decode_health_interval_s, metrics, admit=admit)


def parity_recheck(service: PrefillService, scfg: ServerConfig, parity: ParityOutcome,
                   fleet: tuple[DecodeFacts, ...]):
    """A decode back from down is probed again (``token_parity.recheck``) before it takes requests:
    a restart may have given it another tokenizer or chat template. None when nothing was probed at
    start-up (no decode to ask)."""
    if not parity.reports:
        return None
    from prefill_server.serving import token_parity
    from prefill_server.serving.decode_tokenizer import DecodeTokenizer

    models = {f.url.rstrip("/"): f.served_model_name for f in fleet}

    async def admit(d: Decode) -> str | None:
        tok = DecodeTokenizer(d.url, models.get(d.url.rstrip("/"), service.info.served_name),
                              request_timeout_s=scfg.decode_timeout_s)
        why = await asyncio.to_thread(token_parity.recheck, service.tokenizer, parity, tok)
        service.metrics.tokenizer_parity.labels(d.url).set(1 if why is None else 0)
        if service.through_decode is not None:
            service.through_decode.hold_out(d.url, why is not None)
        if why is not None:
            log.warning("decode %s answers again but stays out of rotation: %s", d.url, why)
        return why

    return admit


def follow_decode(ecfg: EngineConfig, facts: DecodeFacts | None) -> EngineConfig:
    """``--dtype auto`` is the decode's dtype when it says (VLLM_SERVER_DEV_MODE=1); an explicit
    one must be the decode's: the KV we send is only usable in the decode's own dtype."""
    if facts is None or facts.dtype is None:
        return ecfg
    if ecfg.dtype == "auto":
        return dataclasses.replace(ecfg, dtype=facts.dtype)
    if ecfg.dtype != facts.dtype:
        raise ValueError(f"--dtype {ecfg.dtype}, but the decode at {facts.url} runs {facts.dtype}: start the "
                         f"prefill with --dtype {facts.dtype} (or auto), or the decode with --dtype {ecfg.dtype}")
    return ecfg


_NATIVE_CACHE_DTYPES = ("bfloat16", "float16", "half", "float32", "float")  # vLLM's unquantized names


def follow_decode_cache(ecfg: EngineConfig, scfg: ServerConfig, facts: DecodeFacts | None) -> EngineConfig:
    """``--kv-cache-dtype auto`` is a vLLM decode's FP8 when its /metrics says so; an explicit one
    must be the decode's. FP8 pages go only to vLLM decodes that pull them (nixl-compat; local keeps
    them here)."""
    theirs = facts.cache_dtype if facts is not None and not facts.declared else "auto"
    if theirs not in ("auto", *_NATIVE_CACHE_DTYPES):  # (a native name: the model's dtype, or the
        # producer's check refuses the pairing)
        if theirs not in KV_CACHE_DTYPES:
            raise ValueError(f"the decode at {facts.url} runs --kv-cache-dtype {theirs}, which this prefill "
                             f"server does not write: start it with --kv-cache-dtype auto or fp8")
        if ecfg.kv_cache_dtype == "auto":
            log.info("KV pages in %s, as the decode at %s stores them (--kv-cache-dtype)", theirs, facts.url)
            ecfg = dataclasses.replace(ecfg, kv_cache_dtype=theirs)
    elif ecfg.kv_cache_dtype != "auto" and facts is not None and not facts.declared:
        raise ValueError(f"--kv-cache-dtype {ecfg.kv_cache_dtype}, but the decode at {facts.url} stores its KV "
                         f"cache in the model's dtype: start it with --kv-cache-dtype {ecfg.kv_cache_dtype}, or "
                         "this server with --kv-cache-dtype auto")
    if ecfg.kv_cache_dtype != "auto" and (scfg.decode_engine == "sglang" or scfg.transfer_mode == "connector"):
        what = "SGLang decodes take" if scfg.decode_engine == "sglang" else "--transfer-mode connector takes"
        raise ValueError(f"--kv-cache-dtype {ecfg.kv_cache_dtype} works with vLLM decodes that pull KV "
                         f"(--transfer-mode nixl-compat); {what} KV in the model's dtype: use --kv-cache-dtype auto")
    return ecfg


def bind(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound (not yet listening: connections are refused until the server serves),
    or an OSError naming --host / --port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets' connections; without it each
    # response (head and body written apart) waited ~40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise OSError(f"--host {host}: not an address of this machine, nor a name that resolves ({e.strerror})") \
            from None
    except OSError as e:
        sock.close()
        raise OSError(f"HTTP cannot listen on {host}:{port} (--host, --port): {e.strerror}; is the port in use, "
                      "or the address not this machine's?") from None
    return sock


def freeze_startup_objects() -> None:
    """Move everything start-up made (the model's modules, the tokenizer's vocabulary, the libraries'
    objects: ~350K on the embedded model) out of the cyclic collector's reach. A full collection over
    them took 100-190 ms on the 2-core CPU box, and it runs on whichever thread allocates at the time,
    the event loop's included: a 429 or a health check that should take milliseconds waited for it.
    What requests allocate later is collected as before."""
    gc.collect()
    gc.freeze()


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: it re-raises a caught SIGTERM once it has served,
    which ends the process before our cleanup (gRPC drain, engine stop) runs. ``serve`` handles
    the signals itself."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # (a second signal) uvicorn leaves the requests in flight and the app's own
            tasks = list(self.server_state.tasks)  # shutdown to asyncio.run's final cancel: end them here,
            for t in tasks:  # each with its 503 (RequestGuard), then the app's shutdown
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5.0)
            await self.lifespan.shutdown()


def serve(ecfg: EngineConfig, scfg: ServerConfig) -> None:
    api_key = load_api_key(scfg.api_key, scfg.api_key_file)
    api_keys = ApiKeys(api_key, scfg.protect_metrics) if api_key else None
    if scfg.protect_metrics and api_keys is None:
        raise ValueError("--protect-metrics needs an API key (--api-key-file, PREFILL_SERVER_API_KEY or --api-key)")
    if scfg.transfer_mode == "connector" and scfg.decode_engine != "sglang":
        from kv_transfer import wire

        wire.load_secret(secret_file=scfg.connector.secret_file)  # (before any decode is waited for)
    sock = bind(scfg.host, scfg.port)  # first: a port in use is said at once, not after the model loads
    try:
        scfg = resolve_decode_engine(scfg)
        backend = backend_for(scfg)
        fleet = discover_fleet(scfg, backend, None, ecfg)
        parity = check_tokenizers(ecfg, scfg, fleet)
        service = build_service(ecfg, scfg, fleet, parity)
    except BaseException:
        sock.close()
        raise
    try:
        service.worker.start()  # (a pool: Ray, and its first worker running)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]

    async def main() -> None:
        decodes = decode_set(fleet, backend, scfg, service.metrics, parity_recheck(service, scfg, parity, fleet))
        drain = asyncio.Event()
        app = create_app(service, decodes, api_keys, max_body_bytes=scfg.max_body_bytes, drain=drain)
        server = _Uvicorn(uvicorn.Config(app, log_level="warning", access_log=False,
                                         timeout_graceful_shutdown=scfg.drain_timeout_s))
        loop = asyncio.get_running_loop()
        grpc_server = None

        def on_signal(sig: signal.Signals) -> None:
            if drain.is_set():
                log.warning("%s again: stopping now", sig.name)
                server.force_exit = True
                return
            log.warning("%s received: draining (readiness and gRPC health report NOT_SERVING, in-flight "
                        "requests get up to %g s)", sig.name, scfg.drain_timeout_s)
            drain.set()
            if grpc_server is not None:
                asyncio.ensure_future(grpc_server.health.enter_graceful_shutdown())
            server.should_exit = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            if scfg.grpc_port is not None:
                grpc_server = await start_grpc(service, scfg.host, scfg.grpc_port, api_keys=api_keys,
                                               tls_cert=scfg.grpc_tls_cert, tls_key=scfg.grpc_tls_key,
                                               tls_client_ca=scfg.grpc_tls_client_ca)
                if decodes is not None:
                    decodes.subscribe(lambda up: asyncio.ensure_future(grpc_server.set_serving(up)))
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                freeze_startup_objects()
                url_host = f"[{host}]" if ":" in host else host
                if grpc_server:
                    print(f"prefill-server gRPC on {url_host}:{grpc_server.port}"
                          + (" (TLS)" if scfg.grpc_tls_cert else ""), flush=True)
                print(f"prefill-server listening on http://{url_host}:{port} (model {service.info.served_name}, "
                      f"transfer {backend.name}"
                      + (f", SGLang bootstrap port {backend.bootstrap_port}" if backend.bootstrap_port else "")
                      + (f", decode {', '.join(scfg.decode_urls)}" if decodes else "")
                      + (", prefill instance for PD routers" if backend.needs_decode and not decodes else "")
                      + ")", flush=True)
            await task
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if grpc_server:
                await grpc_server.stop(5.0)  # in-flight calls end first; their KV is freed
            service.worker.stop()
            if decodes:
                await decodes.close()
            log.info("stopped: engine, gRPC and decode client closed")

    asyncio.run(main())
    sys.stdout.flush()
