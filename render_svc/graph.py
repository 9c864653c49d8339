"""The render graph: every render stage as one row (which stage service it calls, with which calls, what it consumes
and produces, whether its replicas hold per-job weights), and each mode's route through it, built from the
contract's render plans (`minimax_h3.contract.RENDER_PLANS`).

The planner (its stage order and the stages whose batches go round by the replica's affinity), the engine (which
service a stage's calls reach), the cluster view (which replicas report an affinity) and the job records (a job's
route, the HTTP API's progress) read this table; no other module names a stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from minimax_h3.contract import (GUIDE_FRAMES, GUIDE_PREFIX, KEYFRAME_TENSORS, REF_PREFIX, RENDER_PLANS,
                                 SAMPLE_INPUTS, SAMPLE_OUTPUTS, TAIL_AUDIO, TAIL_VIDEO, TEXT_STATES, TEXT_TAGS)


@dataclass(frozen=True)
class Step:
    """One render stage. `consumes` / `produces`: the request fields and tensors it reads and the tensors (or the
    MP4) it leaves for the next stages (a name ending in `*` stands for each indexed one). `affinity`: its replicas
    hold per-job weights (the DiT: a partition and LoRAs), so a batch goes round by what the replica holds
    (render_svc/planner.py, `batch_rounds`) and the replica's affinity is recorded when a batch is assigned."""

    stage: str
    service: str
    calls: tuple[str, ...]
    consumes: tuple[str, ...]
    produces: tuple[str, ...]
    affinity: bool = False


STEPS = (
    Step("keyframes", "decoder", ("EncodeImage", "EncodeReference", "EncodeTail"),
         consumes=("first_frame", "last_frame", "references", "guides", "extend source"),
         produces=(*KEYFRAME_TENSORS.values(), f"{REF_PREFIX}*", f"{GUIDE_PREFIX}*", GUIDE_FRAMES, TAIL_VIDEO,
                   TAIL_AUDIO)),
    Step("encoder", "encoder", ("Encode",),
         consumes=("prompt", "more_prompts", "first_frame", "last_frame", "references"),
         produces=(TEXT_STATES, TEXT_TAGS)),
    Step("dit", "dit", ("Sample",), consumes=SAMPLE_INPUTS, produces=SAMPLE_OUTPUTS, affinity=True),
    Step("decoder", "decoder", ("Decode",), consumes=SAMPLE_OUTPUTS, produces=("mp4",)),
)


class RenderGraph:
    """The rows by stage, in render order, and each mode's route (its stages, in order)."""

    def __init__(self, steps: tuple[Step, ...], plans: dict[str, tuple[str, ...]]):
        self.steps = MappingProxyType({s.stage: s for s in steps})
        unknown = {stage for plan in plans.values() for stage in plan} - set(self.steps)
        if unknown:
            raise ValueError(f"render plans name stages without a row in the render graph: {sorted(unknown)}")
        for mode, plan in plans.items():
            if list(plan) != sorted(plan, key=list(self.steps).index):
                raise ValueError(f"render plan {mode} {plan} is out of the render graph's order {tuple(self.steps)}")
        self.plans = MappingProxyType(dict(plans))

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(self.steps)

    def service_of(self, stage: str) -> str:
        return self.steps[stage].service

    def affinity(self, stage: str) -> bool:
        return self.steps[stage].affinity

    @property
    def affinity_services(self) -> frozenset[str]:
        """The stage services whose replicas hold per-job weights (their Status says which)."""
        return frozenset(s.service for s in self.steps.values() if s.affinity)

    def route(self, mode: str) -> tuple[str, ...]:
        """The stages a job of `mode` walks, in order."""
        return self.plans[mode]

    def next_stage(self, stage: str, route: tuple[str, ...]) -> str | None:
        """The stage after `stage` in `route` (None after the last)."""
        i = route.index(stage) + 1
        return route[i] if i < len(route) else None


GRAPH = RenderGraph(STEPS, RENDER_PLANS)
