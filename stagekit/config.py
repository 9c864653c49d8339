"""Stage configuration: one dataclass per stage, filled from flags > env > file > defaults.

`parse_config(Cls, argv, env_prefix)` derives the command-line flags from the
dataclass fields, so a new setting is one field with a default and a comment. A field whose values are a fixed
set names them in `metadata["choices"]`: a value outside it (flag, env var or config file) stops the process at
parse time with the list, instead of failing at the first job.
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


def _shown_default(value) -> str:
    """A default as a user would type it: on/off, comma lists, bare strings; "" when there is none to show."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return "" if value is None else str(value)


def _switch_values(argv: list[str], switches: set[str]) -> list[str]:
    """`--flag true|false` and `--flag=false` -> `--flag` / `--no-flag`: on/off settings are switches on the command
    line, and the spelling env vars and config files use (true/false, on/off, yes/no, 1/0) works there too."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if name in switches:
            if not eq and i + 1 < len(argv):
                try:
                    val, eq = str(_bool(argv[i + 1])), "="
                    i += 1
                except ValueError:
                    pass
            if eq:
                try:
                    a = name if _bool(val) else "--no-" + name[2:]
                except ValueError as e:
                    raise SystemExit(f"{name}: {e}; use {name} or --no-{name[2:]}") from None
        out.append(a)
        i += 1
    return out


def _group_title(owner, description: str) -> str:
    """A help section per config class: its docstring's first line (a class without one: `description`'s)."""
    doc = owner.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(owner.__name__ + "("):  # dataclass' generated signature
        return f"{description or 'this stage'}: its own settings"
    return doc.strip().splitlines()[0].rstrip(".")


def comma_choices(choices: typing.Iterable[str]) -> typing.Callable[[str], str]:
    """An argparse `type` for a flag that takes a comma-separated subset of `choices` ("a,b"; "" for none): the
    text as given once every item is one of them, else an error at parse time naming the unknown items and the
    choices (argparse's `choices` for a list in one argument)."""
    allowed = tuple(choices)

    def check(text: str) -> str:
        unknown = [item for item in text.split(",") if item and item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; choose from "
                                             f"{', '.join(allowed)}")
        return text

    return check


def parse_config(cls, argv: list[str] | None = None, env_prefix: str = "H3_", description: str = ""):
    """Build `cls` from CLI flags, then `<env_prefix><FIELD>` env vars, then `--config` YAML/JSON."""
    import sys

    hints = typing.get_type_hints(cls)
    # A field marked `set_by` in its metadata is filled in by the process itself, never by a user.
    fields = [f for f in dataclasses.fields(cls) if f.init and "set_by" not in f.metadata]
    by_name = {f.name: f for f in fields}
    # The stage's package is what a user runs: `python -m dit_svc`, whatever file holds the config class.
    ap = argparse.ArgumentParser(prog=f"python -m {cls.__module__.split('.')[0]}", description=description)
    ap.add_argument("--config", type=Path, help="YAML or JSON file with any of the settings below")
    # Flags grouped by the config class that first declares them (serving, then every stage's, then this stage's).
    owners = [c for c in reversed(cls.__mro__) if dataclasses.is_dataclass(c)]
    groups = {c: ap.add_argument_group(_group_title(c, description)) for c in owners}
    switches = set()
    argv = sys.argv[1:] if argv is None else list(argv)
    for f in fields:
        group = groups[next(c for c in owners if f.name in c.__dict__.get("__annotations__", {}))]
        flag = "--" + f.name.replace("_", "-")
        if "env_only" in f.metadata:  # a secret: never a flag (the command line is public on the host)
            if any(a == flag or a.startswith(flag + "=") for a in argv):
                raise SystemExit(f"{flag} is not accepted on the command line: {f.metadata['env_only']} "
                                 f"({env_prefix}{f.name.upper()})")
            continue
        help_ = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        shown = _shown_default(default)
        # A help text that explains its own default keeps it; an empty default is not worth a line.
        note = f"default: {shown}; " if shown and "default" not in help_.lower() else ""
        kw: dict = {"metavar": f.name.upper()}
        if "choices" in f.metadata:
            kw = {"choices": tuple(f.metadata["choices"])}
        if hints[f.name] is bool:  # on/off: --insecure / --no-insecure
            switches.add(flag)
            kw = {"action": argparse.BooleanOptionalAction}
        group.add_argument(flag, dest=f.name, default=None, help=f"{help_} ({note}env {env_prefix}{f.name.upper()})",
                           **kw)
    ns = ap.parse_args(_switch_values(argv, switches))
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
        cli = getattr(ns, f.name, None)
        if cli is not None:
            values[f.name] = cli
    out = {}
    for name, raw in values.items():
        try:
            out[name] = _converter(hints[name])(raw) if raw is not None else None
        except (TypeError, ValueError) as e:
            raise SystemExit(f"setting {name}: cannot read {raw!r}: {e}") from None
        choices = by_name[name].metadata.get("choices")
        if choices is not None and out[name] is not None and out[name] not in choices:
            raise SystemExit(f"setting {name}: {out[name]!r} is not one of {', '.join(map(repr, choices))}")
    return cls(**out)
