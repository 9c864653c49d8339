"""The package layout is the architecture: `stagekit` (model-agnostic serving) never imports the model package
`minimax_h3`, the model package never imports a stage, no stage imports another, no stage imports `client`, and
`client` imports no stage (docs/design.md). The render service owns its stage calls (`render_svc.stage_calls`); the
one arrow from `client` into a stage is the load tester's to those calls (`ALLOWED`). What the thin client cannot
check itself it asks of the render service over gRPC (its Submit), never by importing stage code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("encoder_svc", "dit_svc", "decoder_svc", "render_svc")
FORBIDDEN = {
    "stagekit": ("minimax_h3", *STAGES, "client"),
    "minimax_h3": (*STAGES, "client"),
    **{s: (*(o for o in STAGES if o != s), "client") for s in STAGES},
    "client": STAGES,
}
# (file, module) arrows the table above would forbid, each on purpose: the load tester sends the render service's own
# stage calls, so one stage call is measured exactly as the render service makes it.
ALLOWED = {("client/loadtest.py", "render_svc.stage_calls")}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports absolutely, inside functions too."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def forbidden_imports(path: Path, package: str) -> list[str]:
    rel = str(path.relative_to(ROOT))
    return sorted({m for m in imported_modules(path)
                   if m.split(".")[0] in FORBIDDEN[package] and (rel, m) not in ALLOWED})


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downward(package):
    bad = {str(p.relative_to(ROOT)): forbidden_imports(p, package) for p in sorted((ROOT / package).rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}, f"{package} must not import {FORBIDDEN[package]}"
