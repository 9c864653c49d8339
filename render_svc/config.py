"""The render service's scheduler settings (render_svc/server.py's `RenderConfig.scheduler()` fills them from its
flags)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from render_svc.stalls import STALL_TIMEOUT_S


@dataclass(frozen=True)
class SchedulerConfig:
    run_dir: Path
    max_batch: int = 8               # jobs per stage batch (keep <= the stages' --max-queue)
    max_wait_batches: int = 4        # fairness bound: batches a ready job may wait
    max_attempts: int = 2            # runs of a job (a restart during a run retries it while attempts remain)
    stage_retries: int = 3           # UNAVAILABLE answers from a stage tolerated per job
    max_jobs_queued: int = 256       # QUEUED jobs beyond this: RESOURCE_EXHAUSTED
    keep_jobs: int = 100             # retention of finished outputs (0 = no limit on that axis)
    keep_bytes: int = 10 << 30
    keep_age_s: float = 7 * 86400.0
    job_deadline_s: float = 6 * 3600.0   # a busy stage is waited out until this long after the job's submission
    stall_timeout_s: float = STALL_TIMEOUT_S  # a replica silent on a batch's calls this long loses the batch
    retention_every_s: float = 60.0      # retention (and the database file check) runs this often
    pipeline: bool = True            # stage groups that share no device run at once (False: one batch at a time)
