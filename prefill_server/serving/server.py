"""Assemble and run the server: engine + transfer producer + HTTP gateway (one process)."""
from __future__ import annotations

import asyncio
import logging
import socket
import sys
from dataclasses import dataclass

import uvicorn

from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.engine import build
from prefill_server.engine.engine import Engine
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.serving.grpc_server import start_grpc
from prefill_server.serving.http import create_app
from prefill_server.serving.proxy import DecodeClient
from prefill_server.serving.service import ModelInfo, PrefillService

log = logging.getLogger(__name__)


def build_service(ecfg: EngineConfig, scfg: ServerConfig) -> PrefillService:
    m = build.load(ecfg)
    decode_info = None
    if scfg.transfer_mode == "nixl-compat":
        from kv_transfer.vllm.v0_32 import discover_decode

        decode_info = discover_decode(scfg.decode_url, attn_backend_name=scfg.decode_attn_backend,
                                      timeout_s=30.0)
    elif scfg.transfer_mode == "connector":
        decode_info = probe_decode(scfg.decode_url)
    block_size = ecfg.block_size or (decode_info.block_size if decode_info else None)
    pool = build.make_pool(ecfg, m, block_size)
    if scfg.transfer_mode == "connector":
        from kv_transfer import wire
        from kv_transfer.push import PushProducer

        geometry = wire.Geometry(model_fingerprint=wire.fingerprint_of_dir(m.path),
                                 num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads,
                                 head_dim=pool.head_dim, block_size=pool.block_size,
                                 dtype=str(pool.dtype).removeprefix("torch."))
        transfer_timeout_s = scfg.transfer_timeout_for(ecfg.lease_ttl_s)
        if transfer_timeout_s > ecfg.lease_ttl_s:
            log.warning("--transfer-timeout %g s is longer than --lease-ttl %g s: the staging blocks of a "
                        "WRITE stuck to a dead decode stay held that long", transfer_timeout_s, ecfg.lease_ttl_s)
        producer = PushProducer(pool, geometry, wire.load_secret(secret_file=scfg.secret_file),
                                host=scfg.side_channel_host, port=scfg.side_channel_port,
                                register_timeout_s=scfg.register_timeout_s,
                                transfer_timeout_s=transfer_timeout_s, lease_ttl_s=ecfg.lease_ttl_s)
        served = scfg.served_model_name or decode_info.served_model_name
    elif decode_info is None:
        producer, served = LocalProducer(pool, ecfg.lease_ttl_s), scfg.served_model_name or m.path
    else:
        from kv_transfer.vllm.v0_32 import NixlCompatProducer

        producer = NixlCompatProducer(pool, decode_info, host=scfg.side_channel_host,
                                      port=scfg.side_channel_port, lease_ttl_s=ecfg.lease_ttl_s)
        served = scfg.served_model_name or decode_info.served_model_name
    c = m.config
    if m.device.type == "cpu":
        build.configure_cpu(ecfg, pool.block_size)
    runner = build.make_runner(m, pool, ecfg.attention)
    engine = Engine(runner, pool, producer, max_model_len=c.max_position_embeddings, vocab_size=c.vocab_size,
                    token_budget=ecfg.token_budget, max_num_seqs=ecfg.max_num_seqs,
                    max_queue_wait_s=ecfg.max_queue_wait_s)
    info = ModelInfo(served, m.path, c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size,
                     c.max_position_embeddings, str(m.dtype).removeprefix("torch."), pool.block_size)
    return PrefillService(engine, m.tokenizer, info, scfg.transfer_mode, first_token=scfg.first_token_mode,
                          eos_token_ids=c.eos_token_ids)


@dataclass(frozen=True)
class ProbedDecode:
    served_model_name: str
    block_size: int | None


def probe_decode(url: str, timeout_s: float = 30.0) -> ProbedDecode:
    """Connector mode needs no vLLM-version facts: the decode's model id and, when its /metrics
    shows it, its KV block size (our pool must use the same; its connector checks it)."""
    import re

    import httpx

    from prefill_server.errors import DecodeUnavailable

    base = url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as http:
            models = http.get(f"{base}/v1/models").raise_for_status().json()["data"]
            metrics = http.get(f"{base}/metrics")
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise DecodeUnavailable(f"cannot query the decode at {base}/v1/models ({e}); check --decode-url "
                                "and that the decode is up") from None
    if not models:
        raise DecodeUnavailable(f"the decode at {base} serves no model")
    hit = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', metrics.text) \
        if metrics.status_code == 200 else None
    return ProbedDecode(str(models[0]["id"]), int(hit.group(1)) if hit else None)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets' connections; without it each
    # response (head and body written apart) waited ~40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(ecfg: EngineConfig, scfg: ServerConfig) -> None:
    service = build_service(ecfg, scfg)
    decode = DecodeClient(scfg.decode_url, scfg.decode_timeout_s) if scfg.transfer_mode != "local" else None
    app = create_app(service, decode, scfg.api_key)
    sock = bind(scfg.host, scfg.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))

    async def main() -> None:
        service.engine.start()
        grpc_server = None
        try:
            if scfg.grpc_port is not None:
                grpc_server = await start_grpc(service, scfg.host, scfg.grpc_port, api_key=scfg.api_key,
                                               tls_cert=scfg.grpc_tls_cert, tls_key=scfg.grpc_tls_key,
                                               tls_client_ca=scfg.grpc_tls_client_ca)
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                url_host = f"[{host}]" if ":" in host else host
                if grpc_server:
                    print(f"prefill-server gRPC on {url_host}:{grpc_server.port}"
                          + (" (TLS)" if scfg.grpc_tls_cert else ""), flush=True)
                print(f"prefill-server listening on http://{url_host}:{port} (model {service.info.served_name}, "
                      f"transfer {scfg.transfer_mode}"
                      + (f", decode {scfg.decode_url}" if decode else "") + ")", flush=True)
            await task
        finally:
            if grpc_server:
                await grpc_server.stop(5.0)  # in-flight calls end first; their KV is freed
            service.engine.stop()
            if decode:
                await decode.close()

    asyncio.run(main())
    sys.stdout.flush()
