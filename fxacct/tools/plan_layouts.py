"""The layouts ``fxacct plan`` considers, and the exact reasons to reject one before any trace.

A layout of N GPUs is pp × fsdp × tp = N (tp within a node: tp divides min(N ÷ pp, GPUs per node);
pp only with a pipeline split), a micro-batch and activation checkpointing off or on. The global
batch is split over the fsdp (data-parallel) ranks: each holds global ÷ fsdp examples per step,
run as A = that ÷ micro-batch micro-batches (gradient accumulation; with pp, the pipeline's M = A
micro-batches).

Rejected before tracing, each by an exact argument: tp not dividing a head count the model
declares (tensor parallelism splits heads); the global batch not dividing over the fsdp ranks;
more pipeline stages than repeated blocks; a pipeline with nothing else (its stages are
traced on one device, which has no mesh time to rank it by); and the parameters alone above the GPU: the ranks
hold every parameter between them, so some rank holds at least (parameter bytes) ÷ N.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxacct.errors import UsageError
from fxacct.load.mesh import MeshSpec
from fxacct.load.source import load_model
from fxacct.load.torchtitan import is_torchtitan
from fxacct.parallel.engine import check_heads
from fxacct.parallel.torchtitan import whole_model
from fxacct.tools.plan_screen import block_container
from fxacct.units import format_bytes


@dataclass(frozen=True)
class Layout:
    pp: int
    fsdp: int
    tp: int
    micro_batch: int  # examples per micro-batch on one rank (0: the batch does not divide)
    accumulation: int  # micro-batches per step (gradient accumulation; with pp the schedule's M)
    checkpoint: bool | None  # activation checkpointing of every repeated block (None: the job's own, torchtitan's)

    @property
    def mesh(self) -> str:
        dims = [(n, s) for n, s in (("pp", self.pp), ("fsdp", self.fsdp), ("tp", self.tp)) if s > 1]
        return ",".join(f"{n}={s}" for n, s in dims) or "fsdp=1"

    @property
    def group(self) -> tuple[int, int, int, bool]:
        """The layouts that differ only by micro-batch: their peak grows with it."""
        return self.pp, self.fsdp, self.tp, self.checkpoint


@dataclass(frozen=True)
class ModelFacts:
    """What the planner reads from the model built once on meta."""

    blocks: int  # repeated blocks in the largest container (fxacct.tools.plan_screen.block_container)
    container: str  # their container's name ("layers"): checkpointing wraps "layers.*"
    param_bytes: int  # every parameter, in the traced dtype


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(gpus: int, global_batch: int, gpus_per_node: int, pipeline: bool,
                      checkpointing: bool | None = True) -> list[Layout]:
    """Every layout, in (pp, tp, checkpointing, micro-batch) order; ``checkpointing``: also with
    activation checkpointing on (off where the model has no repeated blocks to checkpoint; None:
    neither, the job's own, as a torchtitan config says)."""
    out = []
    ckpts = (None,) if checkpointing is None else (False, True) if checkpointing else (False,)
    for pp in divisors(gpus) if pipeline else [1]:
        for tp in divisors(min(gpus // pp, gpus_per_node)):
            if (gpus // pp) % tp:
                continue
            fsdp = gpus // (pp * tp)
            per_rank = global_batch // fsdp if global_batch % fsdp == 0 else 0
            for ckpt in ckpts:
                if not per_rank:
                    out.append(Layout(pp, fsdp, tp, 0, 0, ckpt))
                    continue
                out += [Layout(pp, fsdp, tp, mb, per_rank // mb, ckpt) for mb in divisors(per_rank)]
    return [lay for lay in out if lay.pp * lay.fsdp * lay.tp > 1]


def model_facts(config) -> tuple[ModelFacts, object]:
    """(facts, the model on meta) from one build of config.target (a torchtitan job's: torchtitan's)."""
    model = whole_model(config) if is_torchtitan(config.target) else load_model(config)[0]
    found = block_container(model)
    name = next((n for n, m in model.named_modules() if found and m is found[0]), "")
    size = config.dtype.itemsize if config.dtype is not None else None
    total = sum(p.numel() * (size if size and p.is_floating_point() else p.element_size())
                for p in model.parameters())
    return ModelFacts(len(found[1]) if found else 0, name, total), model


def exact_rejection(layout: Layout, facts: ModelFacts, model, gpus: int, global_batch: int,
                    capacity: int, titan: bool = False) -> str | None:
    """Why the layout cannot run or fit, from arguments that need no trace; None if none applies.
    ``titan``: a torchtitan job, whose pipeline stages are traced as ranks of a mesh even alone."""
    if layout.micro_batch == 0:
        return f"the global batch {global_batch} does not divide over {layout.fsdp} data-parallel ranks"
    if layout.pp > max(facts.blocks, 1):
        return f"pp={layout.pp} is more stages than the model's {facts.blocks} repeated blocks"
    if layout.pp > 1 and layout.fsdp == layout.tp == 1 and not titan:  # fxacct.parallel.pipeline: one device
        return "pp without fsdp or tp: plan times a stage as a rank of a mesh"
    try:
        check_heads(model, MeshSpec((("tp", layout.tp),)))
    except UsageError as e:
        return str(e).removeprefix("--mesh ")
    floor = -(-facts.param_bytes // gpus)
    if floor > capacity:
        return (f"over memory by at least {format_bytes(floor - capacity)}: parameters alone, "
                f"{floor:,} B per GPU")
    return None
