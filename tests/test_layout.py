"""The package layout is the architecture: `stagekit` (model-agnostic serving) never imports the model package
`minimax_h3`, the model package never imports a stage, no stage imports another, and `client` imports no stage
(docs/design.md). The render service may import `client` (`client.pipeline`, `client.stubs`): the client package is
the stage-call library the render service is built on, so the arrow points one way only. What the client cannot
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
    **{s: tuple(o for o in STAGES if o != s) for s in STAGES},
    "client": STAGES,
}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file, inside functions too."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downward(package):
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & set(FORBIDDEN[package]))
           for p in sorted((ROOT / package).rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}, f"{package} must not import {FORBIDDEN[package]}"
