"""Persistent torch.compile cache (stagekit/compile_cache.py): keyed folder, and a second process loads the first
one's compiled graph instead of compiling it (inductor's FX-graph and AOT-autograd cache hits)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stagekit.compile_cache import cache_key

ROOT = Path(__file__).resolve().parents[1]
# A graph that lowers to an extern matmul only: inductor writes and caches its wrapper module without a C++ build,
# so the test measures the cache, not the compiler (a few seconds per process).
CHILD = """
import json, sys, torch
if sys.argv[2] == "late":  # inductor already imported when the cache is enabled
    import torch._inductor.config
from stagekit.compile_cache import enable_compile_cache
lazy = "torch._inductor.config" not in sys.modules
where = enable_compile_cache(sys.argv[1], "cpu")
assert not lazy or "torch._inductor.config" not in sys.modules, "enabling the cache imported inductor"
from torch._dynamo.utils import counters
f = torch.compile(lambda x: x @ x.T, dynamic=False)
f(torch.randn(8, 4))
print(json.dumps({"dir": str(where), **counters["inductor"], **counters["aot_autograd"]}))
"""


def _run(root: Path, when: str = "first") -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), when], capture_output=True, text=True, env=env,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cache_key_names_the_build():
    key = cache_key("cpu")
    assert key.startswith(f"torch-{torch.__version__}") and key.endswith("-cpu") and "/" not in key


@pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "g++", "clang")),
                    reason="torch.compile's CPU backend needs a C compiler")
@pytest.mark.parametrize("when", ["first", "late"])
def test_second_process_reuses_the_compiled_graph(tmp_path, when):
    """Enabled before anything imports inductor (the cheap path: nothing imported) or after: both hit the cache."""
    first = _run(tmp_path, when)
    assert Path(first["dir"]) == tmp_path / cache_key("cpu")
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    assert any((tmp_path / cache_key("cpu") / "fxgraph").rglob("*"))  # written to the keyed folder
    second = _run(tmp_path, when)
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0
    assert second.get("autograd_cache_hit", 0) >= 1
