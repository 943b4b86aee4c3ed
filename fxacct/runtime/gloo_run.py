"""The real multi-process check of ``--mesh ... --runtime --device cpu``: world-size CPU processes
on the gloo backend (``torch.multiprocessing``, at most 8 ranks), the model built with random
weights and parallelized exactly as the account was, one warm-up step, timed steps, then one
step under fxacct's storage tracker (the op-level peak; FSDP2's storage resizes shown to it as
they happen) and a dispatch counter of the collectives the engine issues below DTensor (as
``torch.distributed.tensor.debug.CommDebugMode`` sees them)."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

from fxacct.errors import INTERNAL_HINT, FxacctError, InternalError, ModelError, UsageError, _shown_path
from fxacct.load.mesh import without_pp
from fxacct.load.torchtitan import is_torchtitan
from fxacct.parallel.ddp import is_ddp
from fxacct.parallel.engine import device_mesh, parallelize
from fxacct.parallel.pipeline import _split, resolve_points
from fxacct.parallel.pipeline_schedule import per_rank, schedule_class
from fxacct.parallel.pipeline_split import is_function
from fxacct.runtime import titan_run
from fxacct.runtime.build import build_model, make_inputs
from fxacct.runtime.storage_tracker import StorageTracker
from fxacct.trace import torch_private as tp
from fxacct.trace.loss import training_loss
from fxacct.trace.torch_private.ddp import zero_local_optimizer

MAX_RANKS = 8


@dataclass(frozen=True)
class RankMeasured:
    rank: int
    step_ms: float  # median of the timed steps
    op_level_peak_bytes: int
    collectives: dict  # op -> [count, output-buffer bytes]
    expert_load: list | None = None  # a torchtitan MoE job: its router's tokens per expert, per layer


def collective_family(packet) -> str:
    """torch's name of a collective op, as the account names its kind: c10d's ``_allgather_base_``
    and the functional ``all_gather_into_tensor`` are both ``all_gather``. Derived from the name
    alone, not from fxacct's own op table (fxacct.parallel.collectives), so that a collective the
    account misses shows up here under a name of its own."""
    name = getattr(packet, "__name__", str(packet)).replace("_", "").lower()
    for prefix, family in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
                           ("allreduce", "all_reduce"), ("alltoall", "all_to_all"), ("send", "send"),
                           ("recv", "recv")):
        if name.startswith(prefix):
            return family
    return name


# torch's own registry of collectives (CommDebugMode's), and the pipeline's point-to-point ops
_COUNTED = tp.comm_debug_collectives() | {torch.ops.c10d.send, torch.ops.c10d.recv_}
# context parallelism's custom ops (torch/distributed/tensor/experimental/_context_parallel/_cp_custom_ops.py:
# cplib::flex_cp_allgather and cplib::flex_cp_allgather_backward)
_CP_OPS = "cplib"


class CollectiveCounter(tp.TorchDispatchMode):
    """Each rank's collectives, found by torch's own registry (CommDebugMode's: c10d's and the
    functional ones; its mode itself tracks modules in a way pipelining's stages break) and the
    pipeline's sends and receives, with the output buffer's bytes of each: the first tensor
    argument of a c10d op (it writes there in place), the result of a functional one.
    ``found``: family -> [count, bytes]."""

    def __init__(self):
        super().__init__()
        self.found: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        if getattr(func, "_overloadpacket", None) in _COUNTED:
            written = args[0] if func.namespace == "c10d" else out  # c10d ops write in place
            first = tp.tree_leaves(written)[0]
            acc = self.found.setdefault(collective_family(func._overloadpacket), [0, 0])
            acc[0] += 1
            acc[1] += first.numel() * first.element_size()
        elif getattr(func, "namespace", None) == _CP_OPS:
            # one op gathers k and v (its backward reduce-scatters both gradients) by functional
            # collectives inside its kernel, where this mode does not see them: the op is counted,
            # the bytes of both outputs
            family = "reduce_scatter" if func._overloadpacket.__name__.endswith("_backward") else "all_gather"
            acc = self.found.setdefault(family, [0, 0])
            acc[0] += 1
            acc[1] += sum(t.numel() * t.element_size() for t in tp.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


# The op-level peak in program order is the floor of what a tracked step shows: a collective's
# buffers that gloo's worker thread lets go of late (after the main thread has allocated on) only
# add to it (seen here: +54,336 and +68,608 B over 2,098,552 B in 2 of 5 runs of GPT-2 at fsdp=4,
# the other runs equal to the byte), so the least of a few tracked steps is the rank's peak. Three
# were once all disturbed on one rank of a Hugging Face Llama at fsdp=2 in a full CI run (+49,664 B
# over 1,813,532 B, every other run equal within 2%): five. A pipeline rank's received activations
# too: rank 3 of pp=2,tp=2 once held its four micro-batches' 131,072 B past the peak in a full CI run
# (3,458,692 B against 3,327,580 predicted; equal within 2% in 7 other runs)
TRACKED_STEPS = 5


class AllReduceBuffers(tp.TorchDispatchMode):
    """The buffers a step all-reduces in place (c10d ``allreduce_``): under DDP its gradient
    buckets, which it allocates once (after the first step's rebuild) and keeps, so the tracked
    steps count them from the start as the account does (resident), not from their first use."""

    def __init__(self):
        super().__init__()
        self.buffers: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.allreduce_.default:
            self.buffers += [t for t in args[0] if isinstance(t, torch.Tensor)]
        return func(*args, **(kwargs or {}))


def resizes_seen(tracker):
    """Show each storage FSDP2 resizes (outside the dispatcher) to the tracker right away."""
    return tp.fsdp_storage_resizes(lambda tensor, allocated: tracker.track(tensor))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_runnable(config):
    """The MeshSpec of a mesh the real check can run as the account was traced, else a UsageError."""
    spec = config.mesh
    if spec.world_size > MAX_RANKS:
        raise UsageError(f"--runtime with --mesh {spec} would start {spec.world_size} processes on this "
                         f"machine; the real check runs at most {MAX_RANKS} ranks: use a smaller mesh")
    if spec.size("pp") > 1:  # _measure_pipeline: torch's schedule with a sum loss, no autocast, no wrappers
        given = [flag for flag, on in (("--amp", config.amp is not None), (f"--loss {config.loss}", config.loss != "sum"),
                                       ("--checkpoint", bool(config.checkpoint))) if on]
        if given:
            raise UsageError(f"--runtime with --mesh {spec} runs the pipeline's plain step (the sum of the "
                             f"outputs, no autocast, no checkpointing), not what {given[0]} traces: drop "
                             f"{given[0]} for the real check, or drop --runtime")
    return spec


def run_mesh(config, steps: int = 3, warmup: int = 1) -> tuple[RankMeasured, ...]:
    """Run the parallelized model for real in world-size CPU processes; one RankMeasured each."""
    import torch.multiprocessing as mp

    spec = check_runnable(config)
    if spec.size("pp") > 1:  # every rank cuts the model at the same points, into P × V stages

        points = resolve_points(config, spec.size("pp") * per_rank(config.pp_schedule, config.pp_stages_per_rank))
        config = config if points is None else replace(config, pp_split=",".join(points))
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process ..." when a rank fails
        level, spawn_log.level = spawn_log.level, logging.ERROR
        try:
            mp.start_processes(_rank_main, args=(spec.world_size, port, config, out, steps, warmup),
                               nprocs=spec.world_size, start_method="spawn", join=True)
        except mp.ProcessRaisedException as e:
            raise rank_failure(e.error_index, e.msg) from None
        finally:
            spawn_log.setLevel(level)
        results = []
        for rank in range(spec.world_size):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                results.append(RankMeasured(**json.load(f)))
    return tuple(results)


_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def rank_failure(rank: int, traceback_text: str) -> FxacctError:
    """The one-line error for a rank whose real run raised (its traceback arrives as text): fxacct's
    own code at the deepest frame is an internal error (4), else the model or the engine failed (3)."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    what = lines[-1].strip() if lines else "an error"
    frames = _FRAME.findall(traceback_text)
    at = ""
    if frames:
        path, line, fn = frames[-1]
        at = f" (at {_shown_path(path)}:{line} in {fn})"
        if f"{os.sep}fxacct{os.sep}" in path and "site-packages" not in path:
            return InternalError(f"internal error in the real run on rank {rank}: {what}{at}; {INTERNAL_HINT}")
    return ModelError(f"the real run on gloo failed on rank {rank}: {what}{at}; the account above does not need "
                      "it; rerun with --debug for the traceback")


def _rank_main(rank, world, port, config, out, steps, warmup):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a measuring process: torch's own advice (FSDP2's "returned a view tensor", deprecations) is
    # not the user's output, and every rank would print it once more
    warnings.filterwarnings("ignore", module=r"torch(\.|$)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        measured = _measure(rank, config, steps, warmup)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(measured, f)
        # every rank's gloo work done before any rank tears its group down: a rank that destroyed it
        # while the other's last sends were in flight aborted once in a full CI run ("terminate
        # called without an active exception", SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure(rank, config, steps, warmup) -> dict:
    spec = config.mesh
    if is_torchtitan(config.target):  # torchtitan builds and parallelizes it (fxacct.runtime.titan_run)
        with titan_run.prepared(config) as run:
            measured = _measure_steps(rank, run.model, run.optimizer, run, (run.inputs, run.step.extra), steps, warmup,
                                      before_tracked=run.routed.clear)
            return {**measured, "expert_load": run.expert_load()}
    if spec.size("pp") > 1:
        return _measure_pipeline(rank, spec, config, steps, warmup)
    mesh = device_mesh(spec)
    cpu = torch.device("cpu")
    model, file_module = build_model(config, cpu)
    parallelize(model, spec, mesh, config)
    args, kwargs = make_inputs(config, model, file_module, cpu)  # one seed: every rank the same batch
    opt = config.optimizer_spec().build([p for p in model.parameters() if p.requires_grad])

    def step():
        with torch.autocast("cpu", dtype=config.amp) if config.amp else contextlib.nullcontext():
            loss = training_loss(model(*args, **kwargs), config.loss_output)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    buckets = is_ddp(spec) and not config.parallelize  # DDP's buckets, alive between steps
    return _measure_steps(rank, model, opt, step, (args, kwargs), steps, warmup, ddp_buckets=buckets)


def _measure_steps(rank, model, opt, step, inputs: tuple, steps: int, warmup: int, ddp_buckets: bool = False,
                   before_tracked=None) -> dict:
    """Warm-up and timed steps, then TRACKED_STEPS under the storage tracker and the collective
    counter (``before_tracked`` called before each); ``inputs``: the step's tensors, to track."""
    import torch.distributed as dist

    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        model.zero_grad(set_to_none=True)  # with or without an optimizer: each step starts from none
        dist.barrier()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    kept = AllReduceBuffers()
    if ddp_buckets:
        with kept:
            step()
        model.zero_grad(set_to_none=True)
    peaks = []
    for _ in range(TRACKED_STEPS):
        dist.barrier()
        if before_tracked is not None:
            before_tracked()
        tracker, counter = StorageTracker(), CollectiveCounter()
        with resizes_seen(tracker), tracker, counter:
            tracker.track(model, opt, zero_local_optimizer(opt) if opt is not None else None, *inputs, kept.buffers)
            step()
        model.zero_grad(set_to_none=True)
        peaks.append(tracker.peak_bytes)
    times.sort()
    return {"rank": rank, "step_ms": times[len(times) // 2], "op_level_peak_bytes": min(peaks),
            "collectives": counter.found}


def _pipeline_place(rank, spec):
    """(this rank's pipeline rank, the pp process group or None for the default one, the MeshSpec
    and DeviceMesh each stage is parallelized on, or None with pp alone)."""
    rest = without_pp(spec)
    if rest is None:
        return rank, None, None, None
    mesh = device_mesh(spec)
    sub = mesh[rest.names] if len(rest.names) > 1 else mesh[rest.names[0]]
    return mesh["pp"].get_local_rank(), mesh["pp"].get_group(), rest, sub


def _measure_pipeline(rank, spec, config, steps, warmup) -> dict:
    """This rank's stages (one; V under interleaved 1F1B: r, r + P, ...) under
    torch.distributed.pipelining's schedule over --microbatches, the loss the sum of the last
    stage's output as fxacct's; with more mesh dims than pp, each stage parallelized on the rest
    of the mesh as the account's are (fxacct.parallel.engine.parallelize)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage


    cpu = torch.device("cpu")
    ranks = spec.size("pp")
    pp_rank, group, rest, sub = _pipeline_place(rank, spec)
    m = config.microbatches or ranks
    total = ranks * per_rank(config.pp_schedule, config.pp_stages_per_rank)
    points = None if is_function(config.pp_split) else config.pp_split.split(",")
    parts, stages = [], []
    for s in range(pp_rank, total, ranks):
        model, file_module = build_model(config, cpu)  # a split function may cut the model it is given
        args, kwargs = make_inputs(replace(config, batch=config.batch * m), model, file_module, cpu)
        mb_args = tuple(a.tensor_split(m)[0] for a in args)
        mb_kwargs = {k: v.tensor_split(m)[0] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        parts.append(_split(config, model, s, total, points, mb_args, mb_kwargs))
        if rest is not None:
            parts[-1] = parallelize(parts[-1], rest, sub, config)
        stages.append(PipelineStage(parts[-1], s, total, cpu, group=group))
    kwargs = _accepted(parts[0], kwargs) if pp_rank == 0 else {}  # what stage 0 takes (hf: input_ids)
    schedule = schedule_class(config.pp_schedule)(stages if len(stages) > 1 else stages[0], n_microbatches=m,
                                                  loss_fn=lambda out, target: out.float().sum())
    opt = config.optimizer_spec().build([p for part in parts for p in part.parameters() if p.requires_grad])

    def step():
        if pp_rank == 0:
            schedule.step(*args, **kwargs)
        else:
            schedule.step(target=torch.zeros(config.batch * m))
        if opt is not None:
            opt.step()
        for part in parts:
            part.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    peaks = []
    for _ in range(TRACKED_STEPS):  # the least of a few (TRACKED_STEPS): a received buffer gloo lets go of late
        dist.barrier()
        tracker, counter = StorageTracker(), CollectiveCounter()
        with resizes_seen(tracker), tracker, counter:  # the batch is stage 0's input only
            inputs = (*args, *kwargs.values()) if pp_rank == 0 else ()
            tracker.track(parts, opt, inputs, [_stage_buffers(st) for st in stages])
            step()
        peaks.append(tracker.peak_bytes)
    times.sort()
    return {"rank": rank, "step_ms": times[len(times) // 2], "op_level_peak_bytes": min(peaks),
            "collectives": counter.found}


def _accepted(module, kwargs: dict) -> dict:
    """The tensor keyword inputs ``module``'s forward takes (a stage cut by pipeline() takes the
    model's inputs it reads, by name; a flag such as use_cache is baked into its graph)."""
    params = inspect.signature(module.forward).parameters
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and (open_ended or k in params)}


def _stage_buffers(stage) -> list:
    """The receive buffers a PipelineStage keeps between steps, one per micro-batch: activations
    (``args_recv_info``) and output gradients (``grad_recv_info``)."""
    infos = [i for recv in (stage.args_recv_info, getattr(stage, "grad_recv_info", {})) for i in recv.values()]
    return [i.buffer for group in infos for i in group if not i.is_root_arg and i.buffer is not None]
