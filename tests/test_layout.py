"""The package layout is the architecture: `stagekit` (model-agnostic serving) never imports the model package
`minimax_h3`, the model package never imports a stage, no stage imports another, no stage imports `client`, and
`client` imports no stage (docs/design.md). The render service owns its stage calls (`render_svc.stage_calls`); the
one arrow from `client` into a stage is the load tester's to those calls (`ALLOWED`). What the thin client cannot
check itself it asks of the render service over gRPC (its Submit), never by importing stage code. Inside the render
service, no class grows past `MAX_CLASS_LINES`, and the adapters (gRPC, HTTP, ComfyUI, the page, webhooks) read jobs
through the job book (`render_svc/book.py`), never the store. No product code asks whether an engine has a hook (the
contract gives each a default), and `stagekit` keeps no mutable state in its modules."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from stagekit.engine import StageEngine

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


def engine_probes(path: Path) -> list[str]:
    """`getattr` / `hasattr` calls asking whether an engine has a hook: the hook named by a string, or any
    attribute named by a string of an object whose expression mentions an engine."""
    hooks = {n for n in vars(StageEngine) if not n.startswith("_")}
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        obj, attr = node.args[0], node.args[1]
        named = isinstance(attr, ast.Constant) and isinstance(attr.value, str)
        if named and (attr.value in hooks or "engine" in ast.unparse(obj).lower()):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


PRODUCT = ("stagekit", "minimax_h3", *STAGES, "client")


def test_engine_hooks_are_called_not_probed():
    """The engine contract is `stagekit.engine.StageEngine`: every hook has a default, so nothing (stagekit, a
    stage, the client) asks whether an engine has one: it calls the hook."""
    bad = [p for pkg in PRODUCT for f in sorted((ROOT / pkg).rglob("*.py")) for p in engine_probes(f)]
    assert not bad, "call the StageEngine hook (stagekit/engine.py gives it a default):\n" + "\n".join(bad)


# Calls that make a mutable container; a module-level constant table is a MappingProxyType, a tuple or a frozenset.
MUTABLE_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "bytearray",
                           "local"})
MUTABLE_NODES = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def module_state(source: str, name: str) -> list[str]:
    """Module-level state a process would share between its users, in the module `source` (named `name`): a name
    bound at module level to a mutable container (a dict / list / set display or comprehension, a dict() / list() /
    set() / defaultdict() / ... call, a threading.local()), and every `global` statement (a function rebinding module
    state)."""
    tree = ast.parse(source, name)
    out = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) else None
        call = value.func if isinstance(value, ast.Call) else None
        called = call.id if isinstance(call, ast.Name) else call.attr if isinstance(call, ast.Attribute) else None
        if isinstance(value, MUTABLE_NODES) or called in MUTABLE_CALLS:
            out.append(f"{name}:{node.lineno}: {ast.unparse(node)[:80]}")
    out += [f"{name}:{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return out


def test_stagekit_holds_no_module_level_mutable_state():
    """stagekit keeps no state in its modules: what a load, a stage or a worker needs is handed to it (e.g. the
    weights as a `stagekit.checkpoints.WeightSource`), and its constant tables cannot be changed."""
    bad = [p for f in sorted((ROOT / "stagekit").rglob("*.py"))
           for p in module_state(f.read_text(), str(f.relative_to(ROOT)))]
    assert not bad, ("hand the state in (an object the caller owns); make a constant table a MappingProxyType, a "
                     "tuple or a frozenset:\n" + "\n".join(bad))


def test_the_state_check_sees_each_form():
    source = ("import threading\nfrom collections import defaultdict\nfrom types import MappingProxyType\n"
              "A = {}\nB: list[int] = []\nC = set()\nD = defaultdict(list)\nE = threading.local()\n"
              "F = {k: 1 for k in 'ab'}\nOK = MappingProxyType({'a': 1})\nT = (1, 2)\nS = frozenset({1})\n"
              "def f():\n    global T\n    T = ()\n    local = {}\n")
    found = module_state(source, "m.py")
    assert [f.split(":")[1] for f in found] == ["4", "5", "6", "7", "8", "9", "14"], found


@pytest.mark.parametrize("package", ["encoder_svc", "dit_svc", "decoder_svc"])
def test_every_stage_engine_is_a_stage_engine(package):
    module = importlib.import_module(f"{package}.engine")
    engines = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__
               and c.__name__.endswith("Engine")]
    assert engines and all(issubclass(c, StageEngine) for c in engines), engines


def module_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (absolute or relative, inside functions too)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in packages for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names} & set(files)
        graph[mod] = out - {mod}
    return graph


def test_no_import_cycles():
    """No module imports (at its top or lazily, inside a function) one that imports it back: shared facts live in a
    module below both (e.g. `stagekit/cuda.py`, `minimax_h3/kernels/fp8.py`)."""
    graph = module_graph(("stagekit", "minimax_h3", "render_svc", "client", "encoder_svc", "dit_svc", "decoder_svc"))
    cycles = []
    for start in sorted(graph):  # a path from a module back to itself
        seen, todo = set(), [(start, (start,))]
        while todo:
            mod, path = todo.pop()
            for nxt in sorted(graph[mod]):
                if nxt == start:
                    cycles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, (*path, nxt)))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


MAX_CLASS_LINES = 300
# The render service's adapters: they read jobs through the job book's view methods only.
ADAPTERS = ("server.py", "http_api.py", "comfy_api.py", "comfy_ws.py", "web.py", "webhooks.py")


def test_no_render_service_class_is_too_long():
    """Each class of `render_svc` holds one concern: none is longer than MAX_CLASS_LINES lines."""
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
            for p in sorted((ROOT / "render_svc").rglob("*.py"))
            for n in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES]
    assert not long, f"split these by concern (at most {MAX_CLASS_LINES} lines a class):\n" + "\n".join(long)


def test_adapters_read_jobs_through_the_book():
    """No adapter touches the job store (`.store`): it reads the job book's view (`svc.book`)."""
    bad = [f"render_svc/{name}:{n.lineno}: {ast.unparse(n)}" for name in ADAPTERS
           for n in ast.walk(ast.parse((ROOT / "render_svc" / name).read_text(), name))
           if isinstance(n, ast.Attribute) and n.attr == "store"]
    assert not bad, "read jobs through the job book (render_svc/book.py):\n" + "\n".join(bad)
