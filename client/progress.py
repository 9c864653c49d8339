"""Terminal rendering of progress, timing summaries and status (rich; torch-free, the thin client imports it)."""

from __future__ import annotations

import threading

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

console = Console(stderr=True)


class RenderProgress:
    """One bar per stage run; the DiT bar advances per step and shows s/step and ETA. A stage reads `done in N s`
    once the next stage has started (the pipeline runs them in turn), and every one does at a clean end."""

    def __init__(self):
        self.progress = Progress(
            TextColumn("[bold]{task.fields[stage]:>8}"), BarColumn(), TextColumn("{task.fields[info]}"),
            console=console, transient=False)
        self.tasks: dict[str, int] = {}
        self.done: set[str] = set()
        # A prompts file's jobs are followed by one thread each, all reporting here: one update at a time (an
        # update that starts a stage walks `tasks` while another may add to it).
        self._lock = threading.RLock()

    def __enter__(self) -> "RenderProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            with self._lock:
                for stage in self.tasks:
                    self.finish(stage)
        self.progress.__exit__(exc_type, *exc)

    def finish(self, stage: str) -> None:
        """Mark `stage` done: full bar, `done in N s`, its clock stopped."""
        with self._lock:
            if stage in self.done or stage not in self.tasks:
                return
            self.done.add(stage)
            tid = self.tasks[stage]
            task = self.progress.tasks[tid]
            total = task.total or 1
            self.progress.update(tid, total=total, completed=total, info=f"done in {task.elapsed or 0.0:.1f} s")
            self.progress.stop_task(tid)

    def update(self, p) -> None:
        stage = p.stage or "?"
        with self._lock:
            if stage not in self.tasks or stage in self.done:  # a stage starts (again: fl2va's decoder runs twice)
                for other in self.tasks:  # ... so the ones before it have finished
                    self.finish(other)
                self.tasks[stage] = self.progress.add_task("", total=None, stage=stage, info="")
                self.done.discard(stage)
            tid = self.tasks[stage]
            if p.total:
                info = f"{p.phase} {p.step}/{p.total}"
                if p.step_ms:
                    info += f"  {p.step_ms / 1000:.2f} s/step"
                if p.step and p.step < p.total:
                    info += f"  ETA {p.eta_s:.1f} s"
                self.progress.update(tid, total=p.total, completed=p.step, info=info)
            else:
                self.progress.update(tid, info=f"{p.phase} {p.message}".strip())


def _extra(s) -> dict:
    """Notes per stage: a StageResult's extras (stage-level library), or where a render job's stage ran (StageRun)."""
    extra = getattr(s, "extra", None)
    if extra is not None:
        return extra
    notes = {"batch": s.batch, "batch_size": s.batch_size, "waited_batches": s.waited_batches}
    if s.stage == "dit":
        notes["cached_steps"] = s.cached_steps
        notes["sparse_steps"] = s.sparse_steps
    return notes


def print_summary(output, stages) -> None:
    """`stages`: the StageResults of a stage-level render, or the StageRuns of a render job (both have stage, wall_s
    and the stage's Timing)."""
    t = Table(title=f"wrote {output}", show_lines=False)
    for col in ("stage", "wall", "queue", "lease", "load", "compute", "xfer"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    total = 0.0
    for s in stages:
        tm = s.timing
        total += s.wall_s
        t.add_row(s.stage, f"{s.wall_s:.2f}", f"{tm.queue_s:.2f}", f"{tm.lease_wait_s:.2f}", f"{tm.load_s:.2f}",
                  f"{tm.compute_s:.2f}", f"{tm.transfer_s:.2f}")
    t.add_row("total", f"{total:.2f}", "", "", "", "", "")
    console.print(t)
    for s in stages:
        notes = ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in _extra(s).items())
        console.print(f"  {s.stage}: {notes}")


def print_status(rows) -> None:
    """One block per stage (per replica: `dit/1`, `dit/2`): readable in any terminal width and easy to grep."""
    for stage, ep, health, st in rows:
        print(f"{stage:<8} {ep}  {health}")
        if st is None:
            continue
        weights = ("embedded tiny model (output is noise)" if st.embedded_model else st.weights)
        print(f"         resident={'yes' if st.resident else 'no'}  residency={st.residency}  "
              f"devices={','.join(st.devices) or '-'}  ranks={st.world_size}  queue={st.queue_depth}  "
              f"running={st.running}  jobs_done={st.jobs_done}  memory={st.memory_bytes / 2**20:.1f} MiB")
        print(f"         weights: {weights} [{st.variant}]")
        if st.changed_weight_files:
            print("         weight files changed on disk since the last load (the next load reads them as they are): "
                  + ", ".join(f"{f} ({what})" for f, what in sorted(st.changed_weight_files.items())))
        print(f"         lease holder: {st.lease_holder or '-'}")
        if st.kernels:
            print("         kernels: " + ", ".join(f"{k.op}={k.kernel} ({k.reason})" for k in st.kernels))
