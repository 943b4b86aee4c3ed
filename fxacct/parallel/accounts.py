"""What the mesh adds to a Profile: one rank's collectives and time (ParallelAccount) and, under
pp, every rank's stages (PipelineAccount)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fxacct.load.mesh import MeshSpec
from fxacct.memory.reserved import ReservedAccount
from fxacct.parallel.collectives import CollectiveNode, CollectiveRow
from fxacct.parallel.timing import ParallelTime, Throughput
from fxacct.step import Profile


@dataclass(frozen=True)
class StageAccount:
    stage: int  # the rank's index in the pipeline (its first stage)
    profile: Profile  # one micro-batch on this rank's first stage
    in_flight: int  # micro-batches whose activations the stage holds at once
    peak_bytes: int  # the step replayed in the schedule's order (fxacct.parallel.pipeline_memory)
    send_bytes: int  # per step: activations forward + input gradients backward
    recv_bytes: int
    stages_on_rank: tuple[int, ...] = ()  # the pipeline stages this rank runs (r, r + P, ... interleaved)
    sends: int = 0  # per step: send ops (one per tensor per micro-batch)
    recvs: int = 0
    collectives: tuple = ()  # CollectiveRow of one step on the rest of the mesh (pipeline_collectives)
    # on a CUDA target: the same step through the caching allocator (fxacct.memory.reserved), else None
    reserved: ReservedAccount | None = None
    # the parameters (their local shards) of every stage this rank runs: interleaved, more than
    # ``profile``'s first stage holds (fxacct.parallel.pipeline._rank_account, which makes every one)
    params: int = 0
    param_bytes: int = 0


@dataclass(frozen=True)
class PipelineAccount:
    stages: tuple[StageAccount, ...]
    schedule: str
    microbatches: int
    bubble_fraction: float  # idle share of the step on a rank, from the schedule's order
    stages_per_rank: int = 1
    model_class: str | None = None  # the class of the whole model, before it was cut into stages
    # with a device model: the whole step, the schedule run with each stage's roofline time per
    # micro-batch (forward with the loss, backward) and then the slowest rank's optimizer step;
    # sends, receives and the collectives inside a stage are not on it
    step_s: float | None = None
    # on a CUDA target: the fixed costs outside the caching allocator on each rank (the CUDA context,
    # NCCL's buffers), and what replays every rank's step through the allocator (with_reserved)
    fixed_outside_bytes: int = 0
    replay: Callable[[], tuple[ReservedAccount, ...]] | None = field(default=None, compare=False, repr=False)
    model_params: int = 0  # the whole model's parameters (global shapes), every stage's
    model_frozen_params: int = 0

    @property
    def peak_bytes(self) -> int:
        """The largest rank's peak over the whole step (its in-flight micro-batches included)."""
        return max(s.peak_bytes for s in self.stages)

    def with_reserved(self) -> PipelineAccount:
        """Each rank's StageAccount with its ReservedAccount (on a CUDA target; else as it is)."""
        if self.replay is None or all(s.reserved is not None for s in self.stages):
            return self
        return replace(self, stages=tuple(replace(s, reserved=r) for s, r in zip(self.stages, self.replay())))

    @property
    def largest_reserved(self) -> ReservedAccount | None:
        """After with_reserved on a CUDA target, the ReservedAccount of the rank that needs the most of
        its GPU (reserved at its peak plus the fixed costs outside the allocator), else None."""
        accounts = [s.reserved for s in self.stages if s.reserved is not None]
        return max(accounts, key=lambda r: r.fit_bytes) if accounts else None


@dataclass(frozen=True)
class ParallelAccount:
    mesh: MeshSpec
    rank: int  # the representative rank traced
    collectives: tuple[CollectiveNode, ...]  # every collective node, in issue order
    rows: tuple[CollectiveRow, ...]  # summed by op, mesh dim, phase and module
    time: ParallelTime | None = None  # with --gpu: the critical path over compute and communication
    throughput: Throughput | None = None
    pipeline: PipelineAccount | None = None  # under --mesh pp=P
    node_seconds: dict | None = None  # collective node -> predicted seconds (with --gpu), else None
    model_params: int | None = None  # the whole model's parameters (global shapes), not this rank's shards
    model_frozen_params: int = 0  # of them, those that do not require grad
    resizes: tuple = ()  # FSDP2's storage resizes in the training trace (fxacct.parallel.fsdp_storage)

    @property
    def step_peak_bytes(self) -> int | None:
        """Under pp the largest rank's peak over the whole step (its micro-batches in flight), else
        None: the rank's own training peak is the Profile's."""
        return self.pipeline.peak_bytes if self.pipeline is not None else None

    @property
    def comm_wire_bytes(self) -> int:
        """What this rank sends in a step: its collectives' wire bytes, and under pp its stage's
        sends (activations forward, input gradients back; a send's wire bytes are its bytes)."""
        sends = self.pipeline.stages[self.rank].send_bytes if self.pipeline is not None else 0
        return sum(r.wire_bytes for r in self.rows) + sends
