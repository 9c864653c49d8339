"""Stage settings come from flags > env > config file > defaults."""

import json
from dataclasses import dataclass, field

import pytest

from stagekit.config import parse_config


@dataclass
class Cfg:
    port: int = 1
    insecure: bool = False
    devices: list[str] = field(default_factory=list)
    ratio: float = 0.5


def test_precedence_flags_env_file(tmp_path, monkeypatch):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"port": 3, "ratio": 0.25}))
    monkeypatch.setenv("T_PORT", "4")
    c = parse_config(Cfg, ["--config", str(f)], env_prefix="T_")
    assert c.port == 4 and c.ratio == 0.25
    c = parse_config(Cfg, ["--config", str(f), "--port", "5", "--devices", "cuda:0,cuda:1"], env_prefix="T_")
    assert c.port == 5 and c.devices == ["cuda:0", "cuda:1"]


def test_bool_switch_with_and_without_value(monkeypatch):
    assert parse_config(Cfg, ["--insecure"], env_prefix="T_").insecure is True
    assert parse_config(Cfg, ["--insecure", "false"], env_prefix="T_").insecure is False
    assert parse_config(Cfg, ["--insecure=off", "--port", "2"], env_prefix="T_").insecure is False
    assert parse_config(Cfg, [], env_prefix="T_").insecure is False
    monkeypatch.setenv("T_INSECURE", "true")
    assert parse_config(Cfg, [], env_prefix="T_").insecure is True
    assert parse_config(Cfg, ["--no-insecure"], env_prefix="T_").insecure is False  # the flag beats the env


def test_help_names_the_module_and_shows_each_default_once(capsys):
    from dit_svc.server import DiTConfigArgs

    with pytest.raises(SystemExit) as e:
        parse_config(DiTConfigArgs, ["--help"], env_prefix="H3_DIT_")
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal width
    assert out.startswith("usage: python -m dit_svc ")
    assert "[--insecure | --no-insecure]" in out and "[INSECURE]" not in out
    assert "default: []" not in out and "default: ''" not in out
    assert "(default ~/.cache/h3-stages) (env H3_DIT_CACHE_DIR)" in out  # its own default, not a second one
    assert "(default: 50052; env H3_DIT_PORT)" in out and "(default: off; env H3_DIT_INSECURE)" in out


def test_bad_values_and_unknown_file_keys_exit_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="port"):
        parse_config(Cfg, ["--port", "x"], env_prefix="T_")
    f = tmp_path / "c.yaml"
    f.write_text("prot: 3\n")
    with pytest.raises(SystemExit, match="unknown settings"):
        parse_config(Cfg, ["--config", str(f)], env_prefix="T_")


def test_dit_row_chunk_default_per_mode():
    """--chunk-rows 0 (the default) resolves per mode; a set value is kept; a negative one is refused at start-up."""
    from dit_svc.engine import resolve_chunk_rows
    from stagekit.errors import FailedPrecondition

    assert resolve_chunk_rows(0, compile_blocks=False, tp_size=1) == 4096  # eager: bounds the fp32 temporaries
    assert resolve_chunk_rows(0, compile_blocks=False, tp_size=2) == 4096
    assert resolve_chunk_rows(0, compile_blocks=True, tp_size=1) == 65536
    assert resolve_chunk_rows(0, compile_blocks=True, tp_size=2) == 16384
    assert resolve_chunk_rows(8192, compile_blocks=True, tp_size=1) == 8192
    with pytest.raises(FailedPrecondition, match="--chunk-rows must be a positive row count"):
        resolve_chunk_rows(-1, compile_blocks=False, tp_size=1)
