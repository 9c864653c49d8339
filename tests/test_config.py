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
    """--chunk-rows 0 (the default) resolves per mode, as tuned for the GPU architecture (minimax_h3/kernels/
    tuning.json: the H200's values, which the default entry names for the CPU and unlisted architectures); a set
    value is kept; a negative one is refused at start-up."""
    from dit_svc.engine import resolve_chunk_rows
    from stagekit.errors import FailedPrecondition

    for arch in ("sm_90", "cpu", "sm_120"):
        assert resolve_chunk_rows(0, compile_blocks=False, tp_size=1, arch=arch) == 4096  # bounds fp32 temporaries
        assert resolve_chunk_rows(0, compile_blocks=False, tp_size=2, arch=arch) == 4096
        assert resolve_chunk_rows(0, compile_blocks=True, tp_size=1, arch=arch) == 65536
        assert resolve_chunk_rows(0, compile_blocks=True, tp_size=2, arch=arch) == 16384
    assert resolve_chunk_rows(8192, compile_blocks=True, tp_size=1, arch="sm_90") == 8192
    with pytest.raises(FailedPrecondition, match="--chunk-rows must be a positive row count"):
        resolve_chunk_rows(-1, compile_blocks=False, tp_size=1, arch="sm_90")


# Enum-like settings of each stage, with one value they accept and one they refuse.
ENUM_SETTINGS = [
    ("dit_svc.server", "DiTConfigArgs", "H3_DIT_", "int8_mode", "dequant", "int4"),
    ("dit_svc.server", "DiTConfigArgs", "H3_DIT_", "linear_kernel", "fp8", "fp9"),
    ("dit_svc.server", "DiTConfigArgs", "H3_DIT_", "attention_kernel", "cudnn", "sage"),
    ("dit_svc.server", "DiTConfigArgs", "H3_DIT_", "qkv_layout", "interleaved", "mixed"),
    ("dit_svc.server", "DiTConfigArgs", "H3_DIT_", "residency", "shared", "sometimes"),
    ("dit_svc.server", "DiTConfigArgs", "H3_DIT_", "dtype", "bf16", "float8"),
    ("encoder_svc.server", "EncoderConfigArgs", "H3_ENCODER_", "mode", "compact", "lazy"),
    ("decoder_svc.server", "DecoderConfigArgs", "H3_DECODER_", "preset", "veryslow", "turbo"),
    ("dit_svc.server", "DiTConfigArgs", "H3_DIT_", "partition", "ref2va", "t2va"),
    ("dit_svc.server", "DiTConfigArgs", "H3_DIT_", "log_level", "DEBUG", "verbose"),
    ("render_svc.server", "RenderConfig", "H3_RENDER_", "log_level", "WARNING", "chatty"),
]


@pytest.mark.parametrize("module,cls,prefix,name,good,bad", ENUM_SETTINGS)
def test_enum_settings_are_refused_at_parse_time(tmp_path, monkeypatch, capsys, module, cls, prefix, name, good, bad):
    """A value outside an enum-like setting's set stops the stage before it starts (flag, env var or config file),
    naming the valid values; every valid one passes."""
    import importlib

    Cfg_ = getattr(importlib.import_module(module), cls)
    flag = "--" + name.replace("_", "-")
    assert getattr(parse_config(Cfg_, [flag, good], env_prefix=prefix), name) == good
    with pytest.raises(SystemExit) as e:
        parse_config(Cfg_, [flag, bad], env_prefix=prefix)
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    f = tmp_path / "c.yaml"
    f.write_text(f"{name}: {bad}\n")
    with pytest.raises(SystemExit, match=f"setting {name}: '{bad}' is not one of .*'{good}'"):
        parse_config(Cfg_, ["--config", str(f)], env_prefix=prefix)
    monkeypatch.setenv(prefix + name.upper(), bad)
    with pytest.raises(SystemExit, match=f"setting {name}: '{bad}'"):
        parse_config(Cfg_, [], env_prefix=prefix)


def test_a_stage_with_a_bad_enum_flag_exits_before_it_starts():
    """`python -m dit_svc --int8-mode int4` exits 2 at once with the valid values, not at the first job."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "dit_svc", "--int8-mode", "int4", "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--int8-mode: invalid choice: 'int4' (choose from 'kernel', 'dequant')" in run.stderr


def test_the_render_service_has_its_own_settings_and_no_stage_ones():
    """The render service's settings are its own frozen dataclass: the serving flags every server has, then its own
    (endpoints, job store, batching, retention); none of a stage's (devices, weights, residency, lease, budget)."""
    import dataclasses

    from render_svc.server import RenderConfig
    from stagekit.server import ServeConfig
    from stagekit.stage import CommonConfig

    stage_only = {f.name for f in dataclasses.fields(CommonConfig)} - {f.name for f in dataclasses.fields(ServeConfig)}
    assert not stage_only & {f.name for f in dataclasses.fields(RenderConfig)} - {"temp_dir", "log_level"}
    cfg = parse_config(RenderConfig, ["--encoder", "h:1", "--dit", "h:2", "--decoder", "h:3", "--keep-jobs", "7"],
                       env_prefix="T_RENDER_")
    assert (cfg.keep_jobs, cfg.endpoints().dit) == (7, "h:2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.keep_jobs = 8  # type: ignore[misc]
    for flag in ("--devices", "--residency", "--lease-dir", "--memory-budget-gb", "--weights"):
        with pytest.raises(SystemExit):
            parse_config(RenderConfig, [flag, "1"], env_prefix="T_RENDER_")


def test_the_render_service_loads_no_stage_machinery():
    """Its process imports neither the stage bootstrap nor the lease, the budget, the device worker or the runtime."""
    import subprocess
    import sys

    code = ("import sys, render_svc.server; print(sorted(m for m in sys.modules if m in ('stagekit.stage', "
            "'stagekit.lease', 'stagekit.budget', 'stagekit.device_worker', 'stagekit.runtime')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]


def test_list_flags_of_the_benchmarks_are_refused_at_parse_time(monkeypatch, capsys):
    """A comma-separated flag of a fixed set (bench_dit.py --variants, bench_finite.py --dtypes, ...) exits 2 at
    parse time naming the unknown item and the set, before any model is built. Each script's main() runs in this
    process, as its command line would run it."""
    import argparse
    import importlib.util
    import sys
    from pathlib import Path

    from stagekit.config import comma_choices

    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="a,b", type=comma_choices(("a", "b", "c")))
    assert ap.parse_args([]).parts == "a,b" and ap.parse_args(["--parts", "c"]).parts == "c"
    root = Path(__file__).resolve().parents[1]
    for script, flag, bad in (("bench_dit.py", "--variants", "fp8,fp9"), ("bench_finite.py", "--dtypes", "bf16,int4"),
                              ("one_card.py", "--skip", "parity,render:z")):
        name = f"cli_{script[:-3]}"
        spec = importlib.util.spec_from_file_location(name, root / "benchmarks" / script)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, mod)  # (its dataclasses look their module up)
        spec.loader.exec_module(mod)
        monkeypatch.setattr(sys, "argv", [script, flag, bad])
        with pytest.raises(SystemExit) as e:
            mod.main()
        err = capsys.readouterr().err
        unknown = bad.split(",")[1]
        assert e.value.code == 2 and f"argument {flag}: unknown" in err and repr(unknown) in err \
            and "choose from" in err, err[-2000:]
