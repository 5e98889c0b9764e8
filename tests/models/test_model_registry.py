from __future__ import annotations

import json

import pytest

from prefill_server.errors import UnknownModel
from prefill_server.models import gguf_convert, registry


@pytest.fixture
def fake_convert(tmp_path, monkeypatch):
    """Cache in tmp_path; conversion replaced by a stub that counts calls."""
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def convert(gguf_path, out_dir, dtype=None):
        calls.append(out_dir)
        (out_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        return out_dir

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    monkeypatch.setattr(gguf_convert, "find_default_gguf", lambda: tmp_path / "model.gguf")
    return calls


@pytest.mark.parametrize("name", [None, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_default_model_converted_once(fake_convert, tmp_path, name):
    path = registry.resolve_model(name)
    assert path == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    assert (path / "config.json").is_file()
    assert registry.resolve_model(name) == path and len(fake_convert) == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp folders left behind
    registry.convert_default_model(force=True)
    assert len(fake_convert) == 2 and (path / "config.json").is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_local_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert registry.resolve_model(str(tmp_path)) == tmp_path


def test_unknown_model(tmp_path):
    with pytest.raises(UnknownModel, match="SmolLM2-135M-Instruct") as e:
        registry.resolve_model("meta-llama/Llama-3.1-8B")
    assert "config.json" in e.value.message
    with pytest.raises(UnknownModel):
        registry.resolve_model(str(tmp_path))  # a folder without config.json


def test_empty_cache_env_is_an_error(monkeypatch):
    monkeypatch.setenv(registry.CACHE_ENV, " ")
    with pytest.raises(ValueError, match="PREFILL_SERVER_CACHE"):
        registry.cache_dir()
