"""What a running SGLang decode says about itself: ``GET /server_info``, its resolved server
arguments (SGLang 0.5.23: ``build_server_info`` -> ``ServerArgs.resolved_dict()``, flat field names)
plus its scheduler's state and ``version``. vLLM serves ``/server_info`` only in dev mode, with a
``vllm_config`` and no ``disaggregation_mode``: that key tells the two apart.

    model_path, served_model_name, context_length   the model and its context (or the scheduler's
                                                     max_req_input_len)
    page_size, dtype, kv_cache_dtype                 the KV pages we WRITE into must match
    disaggregation_mode, disaggregation_transfer_backend   must be "decode" and "nixl"
"""
from __future__ import annotations

from typing import Any

from kv_transfer.vllm.discovery import DecodeFacts
from prefill_server.errors import DecodeUnavailable

_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def is_sglang(info: Any) -> bool:
    """Whether a ``/server_info`` answer is an SGLang server's."""
    return isinstance(info, dict) and "disaggregation_mode" in info and "vllm_config" not in info


def server_info(url: str, timeout_s: float = 5.0) -> Any:
    """The decode's ``/server_info`` JSON (None when it has none: 404, a vLLM decode outside dev
    mode). Raises ``DecodeUnavailable`` when the decode cannot be reached or is not up (5xx)."""
    import httpx

    base = url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as http:
            r = http.get(f"{base}/server_info")
    except httpx.HTTPError as e:
        raise DecodeUnavailable(f"cannot query the decode at {base} ({type(e).__name__}: {e}); check "
                                "--decode-url and that the decode is up") from None
    if r.status_code >= 500:
        raise DecodeUnavailable(f"the decode at {base} answered GET /server_info with {r.status_code} (starting?)")
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def facts_of(url: str, info: dict) -> DecodeFacts:
    """The decode's facts from its ``/server_info``; raises ``ValueError`` naming the flag to change
    when it is not an SGLang PD decode over NIXL."""
    base = url.rstrip("/")
    mode, backend = info.get("disaggregation_mode"), info.get("disaggregation_transfer_backend")
    if mode != "decode":
        raise ValueError(f"the SGLang server at {base} runs --disaggregation-mode {mode}: a prefill server sends "
                         "KV to decodes; start it with --disaggregation-mode decode "
                         "--disaggregation-transfer-backend nixl")
    if backend != "nixl":
        raise ValueError(f"the SGLang decode at {base} runs --disaggregation-transfer-backend {backend}: this "
                         "prefill server speaks NIXL; start it with --disaggregation-transfer-backend nixl")
    if str(info.get("kv_cache_dtype") or "auto") != "auto":
        raise ValueError(f"the SGLang decode at {base} runs --kv-cache-dtype {info.get('kv_cache_dtype')}: this "
                         "prefill server sends KV in the model's dtype; start it with --kv-cache-dtype auto")
    model = str(info.get("model_path") or "")
    if not model:
        raise DecodeUnavailable(f"the SGLang decode at {base} names no model_path in its /server_info")
    page = info.get("page_size")
    ctx = info.get("context_length")  # (None unless --context-length: then the scheduler's limit)
    if not isinstance(ctx, int) and isinstance(lim := info.get("max_req_input_len"), int) and lim > 0:
        ctx = lim + 1
    dtype = _DTYPES.get(str(info.get("dtype") or "auto"))  # "auto": the checkpoint's, unknown here
    return DecodeFacts(url=base, vllm_version="", model=model, served_model_name=str(info.get("served_model_name")
                                                                                        or model),
                       max_model_len=ctx if isinstance(ctx, int) and ctx > 0 else None,
                       block_size=page if isinstance(page, int) and page > 0 else 1, dtype=dtype)


def discover(url: str, timeout_s: float = 5.0) -> DecodeFacts:
    """One round of questions (``kv_transfer.vllm.discovery.wait_for`` retries it)."""
    info = server_info(url, timeout_s)
    if not is_sglang(info):  # (it is up: waiting will not make it SGLang)
        raise ValueError(f"the decode at {url.rstrip('/')} does not answer GET /server_info as an SGLang server "
                         "does: list only SGLang decodes with --decode-engine sglang (one prefill server per "
                         "kind of decode), or use --decode-engine vllm for vLLM")
    return facts_of(url, info)
