"""The engine contract: what a stage implements for the job runtime (stagekit/runtime.py) and the device worker
(stagekit/device_worker.py).

A stage's engine subclasses `StageEngine[Spec]`, `Spec` being its job spec (a frozen dataclass of the stage's own:
stagekit never looks inside one). It implements the four abstract methods the runtime cannot do without (`load`,
`unload`, `run`, `resident_bytes`: a class lacking one cannot be instantiated); every other hook has a default that
means "this engine has nothing to say", so the runtime and the worker call each hook plainly and an engine overrides
only what it knows. Every method runs on every rank with the same arguments, except where a hook says otherwise.

Weights reach a load as a `stagekit.checkpoints.WeightSource`: before each job the runtime asks the engine which
files the job needs (`weight_files(spec, inputs)`); a resident engine whose loaded files differ is unloaded and
loaded with the job's (a load-time event, never a swap inside `run`); the source names those files and, in a
device worker's turn, the stage process's host copies of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    from stagekit.checkpoints import WeightSource

Spec = TypeVar("Spec")


class StageEngine(ABC, Generic[Spec]):
    """A stage's engine: load / unload / run on every rank, and the hooks the runtime asks."""

    name: str = ""
    # False for an engine with no device work: it is never moved into a device worker and takes no memory budget
    # (no budget ledger written per job).
    device_work: ClassVar[bool] = True

    # ---- what every engine implements ---------------------------------------------------------------------------
    @abstractmethod
    def load(self, source: WeightSource) -> None:
        """Make everything resident (an operator's Load; shared residency), reading the weights from `source` (the
        files `weight_files` named)."""

    @abstractmethod
    def unload(self) -> None:
        """Drop every resident byte."""

    @abstractmethod
    def run(self, spec: Spec, inputs: dict, ctx: Any) -> dict:
        """One job: `spec` and its input tensors -> its outputs; `ctx` is the job's `stagekit.runtime.JobContext`
        (progress, cancellation, the rank group)."""

    @abstractmethod
    def resident_bytes(self) -> int:
        """Per-device bytes held now."""

    # ---- hooks with defaults --------------------------------------------------------------------------------------
    def load_for(self, spec: Spec, source: WeightSource) -> None:
        """Load only what the job `spec` needs (exclusive residency loads for the job at hand; an operator's Load
        and shared residency load everything). Default: everything. The decoder's keyframe encode loads the VAE
        encoder alone."""
        self.load(source)

    def estimate_peak_bytes(self, spec: Spec | None, inputs: dict) -> int | None:
        """Per-device peak bytes (weights + activations) of a job; `spec=None` means the weights alone. The runtime
        uses it for admission (RESOURCE_EXHAUSTED at submit) and shared-residency reservations. None: the engine
        cannot tell (the runtime then measures what a load holds)."""
        return None

    def weight_bytes(self) -> int | None:
        """For an engine without an estimate: per-device weight bytes from the checkpoint headers, what a
        shared-residency stage reserves for its first load. None: unknown (the first load reserves the whole budget,
        so every idle stage on its devices steps aside once)."""
        return None

    def weight_files(self, spec: Spec | None = None, inputs: Mapping[str, Any] | None = None) -> tuple[Path, ...]:
        """The files a load for the job (`spec`, `inputs`) reads its weights from; `spec=None`: an operator's Load
        (what the engine serves first). Rank 0 asks before each job: a resident engine whose loaded files differ is
        loaded again with these (the DiT's two partitions). The runtime notes which files they were at each load
        (stagekit/file_identity.py), so Status says when one is deleted or replaced under the stage; a one-rank
        device-worker stage keeps them in host memory between turns (stagekit/host_copy.py). Default: no files."""
        return ()

    def derived_copies(self, files: tuple[Path, ...]) -> dict[str, int]:
        """What a load of `files` derives from them that the stage may keep in host memory between turns beside
        them ({key: bytes}; `stagekit.checkpoints.derived_key`). Default: nothing."""
        return {}

    def describe(self) -> dict:
        """What the stage's Status shows of this engine (its weights, kernels, placement: fields of its own).
        Default: nothing."""
        return {}

    def load_report(self) -> dict:
        """Fields the last load adds to the `loaded` event (e.g. where its time went: `load_phases`)."""
        return {}

    def on_result(self, spec: Spec, result: dict) -> None:
        """Runs in the stage process with a finished job's outputs (rank 0), for state that must outlive a device
        worker: the encoder's prompt cache."""

    def worker_state(self) -> Any:
        """What Status shows of the last job, handed by a device worker to its stage process's engine after each job
        (`set_worker_state`); None: nothing."""
        return None

    def set_worker_state(self, state: Any) -> None:
        """Take what a device worker's engine reported of its last job (`worker_state`)."""

    def lost(self) -> bool:
        """True when the engine lost its device state (its device worker died): the runtime unloads it after the
        job, so the next job loads afresh."""
        return False

    @staticmethod
    def prepare_process() -> None:
        """Run by a device worker on standby, before its turn: heavy imports the first load would pay otherwise.
        It must touch no device."""
