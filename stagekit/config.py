"""Stage configuration: one dataclass per stage, filled from flags > env > file > defaults.

`parse_config(Cls, argv, env_prefix)` derives the command-line flags from the
dataclass fields, so a new setting is one field with a default and a comment.
Only the entry points call this; everything below them receives the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from pathlib import Path

import yaml


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def _converter(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _converter(args[0])
    if origin in (list, tuple):
        inner = _converter(typing.get_args(tp)[0])
        return lambda s: [inner(x) for x in (s if isinstance(s, list) else str(s).split(",")) if str(x) != ""]
    if tp is bool:
        return lambda s: s if isinstance(s, bool) else _bool(str(s))
    return tp


def parse_config(cls, argv: list[str] | None = None, env_prefix: str = "H3_", description: str = ""):
    """Build `cls` from CLI flags, then `<env_prefix><FIELD>` env vars, then `--config` YAML/JSON."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", type=Path, help="YAML or JSON file with any of the settings below")
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        # Booleans work as bare switches (--insecure) and with a value (--insecure false).
        bool_kw = dict(nargs="?", const="true") if hints[f.name] is bool else {}
        ap.add_argument(flag, dest=f.name, default=None, **bool_kw,
                        help=f"{help_} (default: {default!r}; env {env_prefix}{f.name.upper()})")
    ns = ap.parse_args(argv)
    values: dict[str, object] = {}
    if ns.config is not None:
        text = ns.config.read_text()
        loaded = json.loads(text) if ns.config.suffix == ".json" else yaml.safe_load(text)
        if not isinstance(loaded, dict):
            raise SystemExit(f"{ns.config}: expected a mapping of settings")
        unknown = set(loaded) - {f.name for f in fields}
        if unknown:
            raise SystemExit(f"{ns.config}: unknown settings {sorted(unknown)}")
        values.update(loaded)
    for f in fields:
        env = os.environ.get(env_prefix + f.name.upper())
        if env is not None:
            values[f.name] = env
        cli = getattr(ns, f.name)
        if cli is not None:
            values[f.name] = cli
    out = {}
    for name, raw in values.items():
        try:
            out[name] = _converter(hints[name])(raw) if raw is not None else None
        except (TypeError, ValueError) as e:
            raise SystemExit(f"setting {name}: cannot read {raw!r}: {e}") from None
    return cls(**out)
