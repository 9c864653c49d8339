"""Terminal rendering of progress, timing summaries and status (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from client.pipeline import RenderResult

console = Console(stderr=True)


class RenderProgress:
    """One bar per stage; the DiT bar advances per step and shows ms/step and ETA."""

    def __init__(self):
        self.progress = Progress(
            TextColumn("[bold]{task.fields[stage]:>8}"), BarColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), console=console, transient=False)
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> "RenderProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, p) -> None:
        stage = p.stage or "?"
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task("", total=None, stage=stage, info="")
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


def print_summary(r: RenderResult) -> None:
    t = Table(title=f"wrote {r.output}", show_lines=False)
    for col in ("stage", "wall s", "queue", "lease wait", "load", "compute", "unload", "transfer", "notes"):
        t.add_column(col, justify="right" if col not in ("stage", "notes") else "left")
    for s in r.stages:
        tm = s.timing
        notes = ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.extra.items())
        t.add_row(s.stage, f"{s.wall_s:.2f}", f"{tm.queue_s:.2f}", f"{tm.lease_wait_s:.2f}", f"{tm.load_s:.2f}",
                  f"{tm.compute_s:.2f}", f"{tm.unload_s:.2f}", f"{tm.transfer_s:.2f}", notes)
    t.add_row("total", f"{r.total_s:.2f}", "", "", "", "", "", "", "")
    console.print(t)


def print_status(rows) -> None:
    t = Table(title="h3-stages")
    for col in ("stage", "endpoint", "health", "resident", "devices", "ranks", "weights", "queue", "lease", "kernels"):
        t.add_column(col)
    for stage, ep, health, st in rows:
        if st is None:
            t.add_row(stage, ep, health, "", "", "", "", "", "", "")
            continue
        kernels = ", ".join(f"{k.op}={k.kernel}" for k in st.kernels)
        weights = ("embedded tiny (noise)" if st.embedded_model else st.weights) + (f" [{st.variant}]" if st.variant else "")
        t.add_row(stage, ep, health, "yes" if st.resident else "no", ",".join(st.devices), str(st.world_size),
                  weights, str(st.queue_depth), st.lease_holder or "-", kernels)
    Console().print(t)
