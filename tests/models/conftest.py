"""Shared fixtures: the embedded GGUF and its converted Hugging Face folder (once per session)."""
from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def smollm_gguf() -> pathlib.Path:
    from prefill_server.models.gguf_convert import find_default_gguf

    try:
        return find_default_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm_dir(smollm_gguf, tmp_path_factory) -> pathlib.Path:
    """SmolLM2-135M-Instruct converted (bfloat16 safetensors), as the registry would cache it."""
    from prefill_server.models.gguf_convert import convert_gguf

    return convert_gguf(smollm_gguf, tmp_path_factory.mktemp("smollm2"))
