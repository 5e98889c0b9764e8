"""`serve --config FILE` and `config dump`: one table of options behind the flags, the file and the
dump, so a known-good server comes back from one file; `--help` is grouped."""
from __future__ import annotations

import argparse

import pytest

from prefill_server import options
from prefill_server.cli import main
from prefill_server.config import ConnectorConfig, ServerConfig

FLAGS = ["--decode-url", "http://d:8100", "--transfer-mode", "connector", "--token-budget", "4096",
         "--transfer-timeout", "12", "--secret-file", "/etc/s", "--protect-metrics", "--api-key-file", "/k",
         "--max-queue-wait", "30", "--grpc-port", "9000", "--log-level", "warning"]


def parse(argv: list[str]) -> options.Settings:
    p = argparse.ArgumentParser()
    options.add_arguments(p)
    return options.settings_from(p.parse_args(argv))


@pytest.mark.parametrize("fmt", ["yaml", "toml"])
def test_dump_round_trips_through_serve_config(tmp_path, capsys, fmt):
    want = parse(FLAGS)
    assert main(["config", "dump", "--format", fmt, *FLAGS]) == 0
    f = tmp_path / f"prefill.{fmt}"
    f.write_text(capsys.readouterr().out)
    got = parse(["--config", str(f)])
    assert got == want
    assert got.server.connector == ConnectorConfig(secret_file="/etc/s", transfer_timeout_s=12.0)
    assert got.engine.token_budget == 4096 and got.server.grpc_port == 9000 and got.log_level == "warning"


def test_flags_win_over_the_file_and_defaults_fill_the_rest(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine:\n  token_budget: 1024\n  max_num_seqs: 8\ndecode:\n  transfer_mode: local\n")
    s = parse(["--config", str(f), "--token-budget", "512"])
    assert s.engine.token_budget == 512 and s.engine.max_num_seqs == 8
    assert s.server.transfer_mode == "local" and s.server.port == ServerConfig().port


@pytest.mark.parametrize("text,needle", [
    ("engine:\n  tokens_budget: 1\n", "did you mean 'token_budget'"),
    ("engnie:\n  token_budget: 1\n", "did you mean 'engine'"),
    ("engine:\n  token_budget: lots\n", "engine.token_budget"),
    ("engine:\n  token_budget: true\n", "engine.token_budget"),
    ("decode:\n  transfer_mode: carrier-pigeon\n", "must be one of"),
    ("engine: [1, 2]\n", "keys and values"),
    ("- a\n- b\n", "sections"),
    ("engine:\n  token_budget: 0\n", "--token-budget"),  # the config's own validation
    ("engine: {token_budget: 1\n", "not valid YAML"),
])
def test_a_bad_file_is_refused_with_what_to_change(tmp_path, capsys, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    assert main(["serve", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err


def test_config_file_must_exist_and_be_yaml_or_toml(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    (tmp_path / "c.ini").write_text("[engine]\n")
    assert main(["serve", "--config", str(tmp_path / "c.ini")]) == 2
    assert ".yaml" in capsys.readouterr().err
    (tmp_path / "bad.toml").write_text("[engine\ntoken_budget=1\n")  # (TOML's parse error is a ValueError)
    assert main(["serve", "--config", str(tmp_path / "bad.toml")]) == 2
    assert "bad.toml is not valid TOML" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be in 0..65535, not 70000" in capsys.readouterr().err


def test_help_is_grouped_and_every_option_is_in_one_group(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for title in options.GROUPS.values():
        assert f"\n{title}:\n" in out, title
    assert len({o.flag for o in options.OPTIONS}) == len(options.OPTIONS)
    assert all(o.group in options.GROUPS for o in options.OPTIONS)
    assert "--decode-attn-backend" in out.split("transfer mode nixl-compat")[1].split("transfer mode connector")[0]


def test_the_api_key_is_never_dumped(capsys):
    assert main(["config", "dump", "--transfer-mode", "local", "--api-key", "s3cret-key"]) == 0
    out = capsys.readouterr()
    assert "s3cret-key" not in out.out and "api_key_file" in out.err


def test_decode_url_repeats_on_the_command_line_and_is_a_list_in_the_file(tmp_path, capsys):
    s = parse(["--decode-url", "http://a:1", "--decode-url", "http://b:2"])
    assert s.server.decode_urls == ("http://a:1", "http://b:2")
    f = tmp_path / "c.yaml"
    f.write_text("decode:\n  decode_url: [http://a:1, http://b:2]\n")
    assert parse(["--config", str(f)]).server.decode_urls == ("http://a:1", "http://b:2")
    f.write_text("decode:\n  decode_url: http://a:1\n")  # one may be given without a list
    assert parse(["--config", str(f)]).server.decode_urls == ("http://a:1",)
    assert main(["config", "dump", "--decode-url", "http://a:1", "--decode-url", "http://b:2"]) == 0
    f.write_text(capsys.readouterr().out)
    assert parse(["--config", str(f)]).server.decode_urls == ("http://a:1", "http://b:2")
    for argv, needle in ((["--decode-url", "http://a:1", "--decode-url", "http://a:1/"], "given twice"),
                         (["--decode-url", "a:1"], "http:// or https://")):
        with pytest.raises(ValueError, match=needle):
            parse(argv)


def test_pool_flags_file_and_checks(tmp_path, capsys):
    L = ["--transfer-mode", "local"]
    s = parse([*L, "--workers", "2", "--routing", "prefix", "--worker-gpus", "auto", "--max-workers", "4"])
    assert s.server.pool.workers == 2 and s.server.pool.routing == "prefix" and s.server.pool.worker_gpus is None
    assert s.server.pool.enabled and s.server.pool.bounds() == (2, 2, 4)
    assert not parse(L).server.pool.enabled  # no pool flags: one engine in this process, no Ray
    assert main(["config", "dump", "--transfer-mode", "local", "--workers", "3", "--worker-gpus", "1"]) == 0
    f = tmp_path / "pool.yaml"
    f.write_text(capsys.readouterr().out)
    got = parse(["--config", str(f)]).server.pool
    assert got.workers == 3 and got.worker_gpus == 1.0
    for argv, needle in ((["--workers", "-1"], "--workers must be >= 0"),
                         (["--workers", "3", "--max-workers", "2"], "--workers 3 is more than --max-workers"),
                         (["--min-workers", "3", "--max-workers", "2"], "more than --max-workers"),
                         (["--min-workers", "2"], "needs --workers"),
                         (["--workers", "2", "--side-channel-port", "5555"], "must be 0 with a worker pool")):
        with pytest.raises(ValueError, match=needle):
            parse([*L, *argv])
    with pytest.raises(SystemExit):  # argparse: not a choice
        main(["serve", "--routing", "random"])
    assert "least-tokens" in capsys.readouterr().err
