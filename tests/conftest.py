"""Shared fixtures: one embedded stack (real server processes on loopback) per test session."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from client.embedded import EmbeddedStack, StackConfig
from minimax_h3.services import StageClients

# Keep each server process from grabbing every core: tests run three of them at once on 2 cores. MKL_DYNAMIC off:
# MKL may otherwise pick fewer threads than asked for a GEMM on its own, which changes float summation order, and the
# bitwise checks (2-rank decode == 1-rank decode) compare results of separate processes (docs/testing.md, "Races
# the suite and the product guard against").
SERVER_ENV = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "MKL_DYNAMIC": "FALSE"}


def pytest_configure(config):
    """An xdist worker (pyproject's `-n 2`) computes on one thread: two workers share the CI's 2 cores, and two
    threads each there mostly spin in OpenMP barriers (docs/testing.md, "Suite time"). Child processes inherit it;
    the stages get SERVER_ENV's counts."""
    if hasattr(config, "workerinput"):
        import torch

        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


# Long files of one or two tests (each runs real stacks or whole commands): handed out first. The other files follow
# by their number of tests, most first, as xdist orders them by default: ordered that way, these few would come last,
# one of them running alone at the end while the other worker idles (docs/testing.md, "Suite time").
LONG_FILES = ("test_readme.py", "test_bench_templates.py", "test_hosts_shared.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    tests = Counter(item.path for item in items)
    # stable: each file keeps its tests' order
    items.sort(key=lambda item: (rank.get(item.path.name, len(LONG_FILES)), -tests[item.path]))


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Embedded tiny models, written once per session (the servers' real first-use path)."""
    return tmp_path_factory.mktemp("h3-cache")


@pytest.fixture(scope="session")
def stack(tmp_path_factory, model_cache):
    """The three stages as real processes (exclusive residency on one virtual device)."""
    run_dir = tmp_path_factory.mktemp("stack")
    s = EmbeddedStack(StackConfig(cache_dir=str(model_cache), run_dir=str(run_dir), devices="virt0",
                                  env=SERVER_ENV, extra_args={s: ["--idle-unload-s", "5", "--metrics-port", "0"]
                                                                 for s in ("encoder", "dit", "decoder")}))
    endpoints = s.start()
    yield s, endpoints
    s.stop()


@pytest.fixture()
def clients(stack):
    _, endpoints = stack
    with StageClients(endpoints) as c:
        yield c
