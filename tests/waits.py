"""Waiting in tests: on a condition, with a generous deadline, never on a guessed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float = 60.0, what: str = "condition", poll_s: float = 0.02) -> T:
    """Poll `cond` until it returns something truthy (returned); fail the test after `timeout_s`. The deadline is
    for a wedged system, not a guess at how long things take: a loaded 2-core machine is slow, never this slow."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
