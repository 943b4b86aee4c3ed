"""The device mesh of ``--mesh dp=2,fsdp=4,tp=8``: named dimensions, outer to inner.

``dp`` replicates (DDP, or the replicate dimension of HSDP), ``fsdp`` shards parameters,
gradients and optimizer state (FSDP2), ``tp`` is tensor parallel, ``pp`` pipeline stages; ``cp``
(context parallel: the sequence sharded) and ``ep`` (expert parallel: experts placed, tokens sent by
all-to-all) run on torchtitan targets (fxacct.load.torchtitan). The world size is the product of the
sizes but ep's: as torchtitan does, ep is carved out of the fsdp x cp x tp ranks. The canonical order (dp, fsdp, tp outermost to innermost)
is required, as torchtitan lays it out: the inner dimensions are the ones placed within a node.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxacct.dtypes import dtype_name
from fxacct.errors import UsageError

DIMS = ("pp", "dp", "fsdp", "cp", "tp", "ep")  # outer to inner
TORCHTITAN_ONLY = ("cp", "ep")  # built by torchtitan's parallelize_fn, not by fxacct's own engine
EXAMPLE = "--mesh fsdp=8,tp=8"


@dataclass(frozen=True)
class MeshSpec:
    dims: tuple[tuple[str, int], ...]  # (name, size), outer to inner

    @property
    def world_size(self) -> int:
        n = 1
        for name, size in self.dims:
            n *= size if name != "ep" else 1  # ep is carved out of the other ranks (module docstring)
        return n

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    def size(self, name: str) -> int:
        return dict(self.dims).get(name, 1)

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.dims)

    def pipelined(self) -> str:
        """This mesh with a pipeline of 2 stages: its pp=1 made pp=2, or pp=2 put first."""
        if "pp" in dict(self.dims):
            return ",".join(f"{name}={2 if name == 'pp' else size}" for name, size in self.dims)
        return f"pp=2,{self}"


def no_pipeline(mesh: MeshSpec | None) -> str:
    """What a usage error says of a mesh without a pipeline, with the mesh that would have one."""
    if mesh is not None and "pp" in dict(mesh.dims):
        return f"--mesh's pp=1 is no pipeline: give pp=2 or more (e.g. --mesh {mesh.pipelined()})"
    return f"--mesh has no pp dimension: add one (e.g. --mesh {mesh.pipelined() if mesh else 'pp=2'})"


def parse_mesh(text: str) -> MeshSpec:
    """'fsdp=8,tp=8' -> MeshSpec((('fsdp', 8), ('tp', 8))). One-line usage errors otherwise."""
    dims: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",")):
        name, eq, size = part.partition("=")
        name = name.strip().lower()
        if not eq:
            raise UsageError(f"--mesh {text!r}: {part!r} is not NAME=SIZE with NAME one of "
                             f"{', '.join(DIMS)} (e.g. {EXAMPLE})")
        if name not in DIMS:
            raise UsageError(f"--mesh {text!r}: fxacct has no mesh dimension {name!r}; the dimensions are "
                             f"{', '.join(DIMS)} (e.g. {EXAMPLE})")
        if not size.strip().isdigit() or int(size) < 1:
            raise UsageError(f"--mesh {text!r}: the size of {name} must be a positive integer")
        if name in dict(dims):
            raise UsageError(f"--mesh {text!r}: {name} is given twice")
        dims.append((name, int(size)))
    order = [DIMS.index(n) for n, _ in dims]
    if order != sorted(order):
        raise UsageError(f"--mesh {text!r}: give the dimensions outer to inner, in the order "
                         f"{', '.join(DIMS)} (the inner ones are placed within a node)")
    return MeshSpec(tuple(dims))


def without_pp(spec: MeshSpec) -> MeshSpec | None:
    """The mesh one pipeline stage runs on (fsdp=2,tp=2), or None when only pp is left."""
    rest = [(n, s) for n, s in spec.dims if n != "pp"]
    return MeshSpec(tuple(rest)) if rest else None


def check_world(mesh: MeshSpec, world_size: int) -> None:
    """--world-size, when given with --mesh, must be the mesh's product."""
    if world_size not in (1, mesh.world_size):
        raise UsageError(f"--mesh {mesh} has {mesh.world_size} ranks but --world-size is {world_size}: "
                         "drop --world-size (the mesh gives it) or make the product match")


def check_config(config) -> None:
    """The --mesh flags of a Config (its mesh already a MeshSpec), before any tracing."""
    spec = config.mesh
    check_world(spec, config.world_size)
    titan = (config.target or "").startswith("torchtitan:")
    given = [d for d in TORCHTITAN_ONLY if d in spec.names]
    if given and not titan:
        raise UsageError(f"--mesh {spec}: {given[0]} (context and expert parallelism) is built by torchtitan's "
                         "parallelize_fn: profile a torchtitan:MODULE:CONFIG target, or drop it")
    if titan and config.parallelize is not None:
        raise UsageError("--parallelize with a torchtitan target: torchtitan's own parallelize_fn parallelizes it; "
                         "drop --parallelize")
    if config.pp_schedule not in ("gpipe", "1f1b", "interleaved-1f1b"):
        raise UsageError(f"--pp-schedule {config.pp_schedule}: use gpipe, 1f1b or interleaved-1f1b")
    v = config.pp_stages_per_rank
    if v is not None and config.pp_schedule != "interleaved-1f1b":
        raise UsageError(f"--pp-stages-per-rank {v} goes with --pp-schedule interleaved-1f1b (the other schedules "
                         "run one stage per rank): add it or drop --pp-stages-per-rank")
    if v is not None and v < 2:
        raise UsageError(f"--pp-stages-per-rank {v}: interleaved 1F1B runs 2 or more stages per rank (one stage "
                         "per rank is --pp-schedule 1f1b)")
    if config.microbatches is not None and config.microbatches < 1:
        raise UsageError(f"--microbatches must be positive, got {config.microbatches}")
    if config.parallelize is not None and without_pp(spec) is None:
        raise UsageError(f"--parallelize with --mesh {spec}: the function shards each pipeline stage over the other "
                         "mesh dimensions (fsdp, tp, dp) and pp has none; drop --parallelize or add them, e.g. "
                         f"--mesh {spec},fsdp=2")
    if config.shard != "none":
        raise UsageError(f"--mesh and --shard {config.shard} both say how ranks share the model: "
                         f"use --mesh fsdp=N for FSDP2, or --world-size N --shard {config.shard} for the quick estimate")
    if config.master_weights:  # its fp32 copies are plain tensors beside FSDP2's and DTensor's shards
        low = dtype_name(config.dtype) if config.dtype is not None else "bfloat16"
        # fxacct's own FSDP2 wrapping takes --amp as its MixedPrecisionPolicy; a --parallelize of the user's, as autocast
        how = ("your --parallelize sets its own fully_shard policies" if config.parallelize is not None
               else f"under FSDP2 its MixedPrecisionPolicy gathers them in {low}")
        raise UsageError(f"--master-weights with --mesh {spec}: fxacct keeps no fp32 copies beside the engine's "
                         f"sharded parameters; use --amp {low} instead of --dtype {low} --master-weights (fp32 "
                         f"parameters, {low} compute; {how})")


PIPELINE_FLAGS = (("--pp-split", "pp_split"), ("--microbatches", "microbatches"),
                  ("--pp-stages-per-rank", "pp_stages_per_rank"))


def check_pipeline_flags(config) -> None:
    """The flags that say how a pipeline runs do nothing without pp in --mesh: a usage error, as
    --parallelize without --mesh is."""
    if config.mesh is not None and config.mesh.size("pp") > 1:
        return
    given = [flag for flag, field in PIPELINE_FLAGS if getattr(config, field) is not None]
    if given:
        raise UsageError(f"{given[0]} says how a pipeline runs, but {no_pipeline(config.mesh)} or drop {given[0]}")
