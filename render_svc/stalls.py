"""The render service's progress watchdog: a replica that stops making progress on a stage batch loses the batch.

The rule (docs/reliability.md, "A hung replica"):

- **Progress** is any message of a batch's stage calls on its replica: a progress event (queued, loading, a step, a
  phase of the decoder's work), a payload chunk received or taken by the stage, and the end of a call. The stage
  serves a batch's calls one after another and only the one it runs reports steps, so the calls of one batch on
  one replica share one clock (`StallWatch`).
- **A stall** is that clock silent for `--stall-timeout-s`: every call still open on the replica is stopped, the
  replica is *suspect*, and each stopped job goes back to its stage's queue to run that stage once more, elsewhere
  (`stall_verdict`). A job whose stage calls stall a second time fails UNAVAILABLE naming both replicas.
- **Suspect** replicas get no work while their service has another replica in rotation (as replicas that do not
  answer), and Status shows them `SUSPECT (...)`. One is back once a Status it answered after the stop shows it
  moving again: idle (no job running or queued), or more jobs done than the first Status after the stop said
  (`Suspects`).

A stage reports "loading" once and nothing more until its first step, so the timeout covers the slowest load of the
largest weights (and a first step's compile) with room to spare: 300 s by default.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from h3.v1 import common_pb2

log = logging.getLogger("render_svc")

STALL_TIMEOUT_S = 300.0  # --stall-timeout-s: the default silence of a batch's calls on a replica before they stop


class StallWatch:
    """The progress clock of one stage batch's calls on one replica: `touch` on every message and call end,
    `stalled` once it has been silent for more than `timeout_s`. Touched from the calls' threads (a float store)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._last = time.monotonic()

    def touch(self, *_args) -> None:
        self._last = time.monotonic()

    def silent_s(self) -> float:
        return time.monotonic() - self._last

    def stalled(self) -> bool:
        return self.silent_s() > self.timeout_s


def stall_verdict(stalled_on: list[str], node: str, stage: str, timeout_s: float) -> str | None:
    """After a job's `stage` call on replica `node` was stopped for a stall (`stalled_on`: the replicas of its
    earlier stalls): None when the job runs the stage once more (on another replica while there is one), else why
    it fails."""
    if not stalled_on:
        return None
    return (f"the {stage} stage made no progress on replica {node} for {timeout_s:g} s (--stall-timeout-s), and this "
            f"job's work had stalled on replica {', '.join(stalled_on)} before: the job runs no more. The replicas "
            "are out of rotation until they move again (SUSPECT in the render service's Status): check their device "
            "workers, then submit the job again")


@dataclass
class Suspect:
    reason: str
    since: float                # time.monotonic() of the stop
    baseline: int | None = None  # jobs_done in the first Status read after the stop


class Suspects:
    """The replicas out of rotation after a stall, until their Status shows them moving again. Not thread-safe: the
    render service calls it under its lock."""

    def __init__(self) -> None:
        self._by_node: dict[str, Suspect] = {}

    def __contains__(self, node: str) -> bool:
        return node in self._by_node

    def __bool__(self) -> bool:
        return bool(self._by_node)

    def mark(self, node: str, stage: str, timeout_s: float) -> None:
        """Replica `node` made no progress on a `stage` batch for `timeout_s`: out of rotation."""
        if node in self._by_node:
            return
        reason = (f"no progress on a {stage} batch for {timeout_s:g} s (--stall-timeout-s), at "
                  f"{time.strftime('%H:%M:%S')}; out of rotation until its Status shows it moving again")
        log.warning("replica %s: %s; its jobs run that stage once more on another replica", node, reason)
        self._by_node[node] = Suspect(reason, time.monotonic())

    def reason(self, node: str) -> str:
        """Why `node` is suspect ("" when it is not)."""
        s = self._by_node.get(node)
        return s.reason if s is not None else ""

    def seen(self, node: str, status: common_pb2.StageStatus, asked: float) -> None:
        """Replica `node` answered Status `status`, asked at `asked` (time.monotonic()): back in rotation when a
        Status asked after the stop shows it idle, or more jobs done than the first such Status said."""
        s = self._by_node.get(node)
        if s is None or asked < s.since:
            return
        idle = not status.running and not status.queue_depth
        if idle or (s.baseline is not None and status.jobs_done > s.baseline):
            del self._by_node[node]
            log.info("replica %s moves again (%s); back in rotation",
                     node, "idle" if idle else f"{status.jobs_done - s.baseline} job(s) done since the stop")
        elif s.baseline is None:
            s.baseline = status.jobs_done
