"""Start a command again when it fails, at most N times in any window of W seconds (stdlib only):

    python -m stagekit.supervise [--max-restarts 3] [--restart-window-s 600] -- COMMAND ...

`scripts/up.sh` runs each multi-rank stage's torchrun under it (torchrun itself restarting nothing): torchrun's own
`--max-restarts` counts over the launcher's whole life, so a rank group that fails once a week would be gone for good
after its third failure. Here the count is per window (docs/reliability.md, "Restarts"): a crash loop still ends
(the fourth failure within the window ends the supervisor with the command's exit status, saying why), a failure
now and then is always restarted.

- The command runs in the supervisor's process group, so a signal to the group reaches both, and dies with the
  supervisor (PR_SET_PDEATHSIG): a `kill -9` of the supervisor leaves no launcher or rank behind.
- SIGTERM / SIGINT / SIGHUP are passed on to the command; nothing is restarted after one, and the supervisor exits
  with the command's status.
- A command that exits 0 is done: so is the supervisor.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from stagekit.procs import die_with_parent, exit_text

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class RestartBudget:
    """At most `limit` restarts in any `window_s` seconds: a restart is allowed while fewer than `limit` were made
    in the `window_s` before it (each one's place frees up `window_s` after it)."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        if limit < 0 or not window_s > 0:
            raise ValueError(f"a restart budget needs limit >= 0 and window_s > 0, got {limit} and {window_s}")
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._times: collections.deque[float] = collections.deque()

    def in_window(self) -> int:
        """Restarts made in the last `window_s`."""
        now = self._clock()
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        return len(self._times)

    def take(self) -> bool:
        """Whether a restart may be made now (it is counted when it may)."""
        if self.in_window() >= self.limit:
            return False
        self._times.append(self._clock())
        return True


def _say(text: str) -> None:
    print(f"supervise: {text}", file=sys.stderr, flush=True)


def supervise(command: list[str], budget: RestartBudget) -> int:
    """Run `command` until it exits 0, a stop signal arrives, or a failure finds the budget spent; its exit
    status (128 + the signal's number for a command killed by one)."""
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def on_signal(signum, _frame) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    name = " ".join(command[:4]) + (" ..." if len(command) > 4 else "")
    me = os.getpid()
    while True:
        child = subprocess.Popen(command, preexec_fn=lambda: die_with_parent("the supervised command", me))
        if stopping:  # the signal came while it started: it has not seen it
            child.send_signal(stopping[0])
        code = child.wait()
        if code == 0 or stopping:
            return code if code >= 0 else 128 - code
        if not budget.take():
            _say(f"{name} ended ({exit_text(code)}); it failed {budget.limit + 1} times within "
                 f"{budget.window_s:g} s (--max-restarts {budget.limit} --restart-window-s {budget.window_s:g}): "
                 "not starting it again")
            return code if code >= 0 else 128 - code
        _say(f"{name} ended ({exit_text(code)}); starting it again (restart {budget.in_window()} of at most "
             f"{budget.limit} in {budget.window_s:g} s)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m stagekit.supervise", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-restarts", type=int, default=3, help="restarts allowed in any --restart-window-s")
    p.add_argument("--restart-window-s", type=float, default=600.0, help="the window the restarts are counted in")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if args.max_restarts < 0 or not args.restart_window_s > 0:
        p.error(f"--max-restarts must be 0 or more and --restart-window-s above 0 (got {args.max_restarts} and "
                f"{args.restart_window_s:g})")
    sys.exit(supervise(command, RestartBudget(args.max_restarts, args.restart_window_s)))


if __name__ == "__main__":
    main()
