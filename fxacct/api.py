"""The library's one entry: a Config (or a model and its inputs) to its Profile. The dispatcher
chooses one device, one rank of a mesh or a pipeline; each is accounted by fxacct.step's driver,
and the fit on the GPU and the roofline's prediction are attached here, the same way for all
three. No formatting (fxacct.report) and no flags (the CLI)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from fxacct.devices import get_device
from fxacct.errors import CompileError, ModelError
from fxacct.heap import collect_dropped, freeze_made, with_frozen_heap
from fxacct.load.config import Config
from fxacct.load.hf import seq_len_note
from fxacct.load.mesh import check_pipeline_flags
from fxacct.load.source import guessed_input_note, load_model
from fxacct.load.torchtitan import is_torchtitan
from fxacct.memory import account as memory_account
from fxacct.memory.account import Fit
from fxacct.memory.fit_lines import LineGuess
from fxacct.memory.fit_search import FLAT_DOUBLINGS, largest_batch
from fxacct.memory.peak import lifetimes
from fxacct.parallel.accounts import ParallelAccount
from fxacct.parallel.pipeline import profile_pipeline
from fxacct.parallel.profile import profile_parallel
from fxacct.parallel.timing import pipeline_throughput
from fxacct.parallel.torchtitan import profile_torchtitan
from fxacct.parallel.torchtitan_pipeline import profile_torchtitan_pipeline
from fxacct.predict.fused_time import predict_profile
from fxacct.step import OneDevice, Profile, TracedFit, account_step, fit_of, input_sizes, inputs_batch, step_fit
from fxacct.trace import fusion
from fxacct.trace.capture import BACKWARD, FORWARD, Capture
from fxacct.trace.checkpointing import CheckpointSide, CheckpointWhatIf, matched_modules
from fxacct.trace.compiled import CompileSide, CompileWhatIf


@with_frozen_heap
def profile(config: Config) -> Profile:
    """Load config.target and account its step: on one device, or one rank of ``config.mesh``
    (under pp, stage 0's rank, carrying every stage's account)."""
    check_pipeline_flags(config)  # a plan's Config may carry them without pp: a profile's may not
    if is_torchtitan(config.target):  # torchtitan parallelizes it on its own meshes (one device: fsdp=1)
        if config.mesh is not None and config.mesh.size("pp") > 1:
            prof = _pipeline(config, profile_torchtitan_pipeline)
            # --batch is torchtitan's local batch; a pipeline's report reads the micro-batch a stage
            # traced; the loss is torchtitan's, the model's own (fxacct.parallel.torchtitan.optimizer_config)
            micro = config.batch // prof.parallel.pipeline.microbatches
            return _predicted(replace(prof, config=replace(prof.config, batch=micro, loss="model")))
        prof = profile_torchtitan(config if config.mesh is not None else replace(config, mesh="fsdp=1"))
        return _predicted(_fitted_rank(prof, prof.memory.fit_bytes, prof.memory.fit_basis))
    if config.mesh is None:
        model, args, kwargs, inputs_for = load_model(config)
        try:
            return _one_device_notes(_profile_module(model, args, kwargs, config, inputs_for))
        except CompileError:  # torch.compile's own error: not the inputs'
            raise
        except ModelError as e:
            note = seq_len_note(model, config.seq_len) or guessed_input_note(config, model)
            if note is None:
                raise
            raise ModelError(f"{note}: {e}") from e
    if config.mesh.size("pp") == 1:
        prof = profile_parallel(config)
        return _predicted(_fitted_rank(prof, prof.memory.fit_bytes, prof.memory.fit_basis))
    return _predicted(_pipeline(config))


@with_frozen_heap
def profile_module(model: torch.nn.Module, args=(), kwargs=None, config: Config | None = None,
                   inputs_for: Callable[[int], tuple] | None = None) -> Profile:
    """Account one training step of ``model(*args, **kwargs)`` on one device: forward, loss,
    backward and the optimizer step, and a forward for inference.

    ``args``/``kwargs`` may be meta tensors (only shapes and dtypes are read); nothing of the
    model's own tensors is allocated or changed. ``inputs_for(batch) -> (args, kwargs)`` lets a
    --gpu profile search the largest batch that fits. Without ``config`` the batch is the inputs'
    first dimension; a ``config`` whose batch is no dimension of any input gets a warning (the
    account is of the inputs as given; its per-example figures divide by config.batch)."""
    kwargs = kwargs or {}
    config = config or Config(batch=inputs_batch(args, kwargs))
    prof = _profile_module(model, args, kwargs, config, inputs_for)
    sizes = input_sizes(args, kwargs)  # a sequence-first input has its batch second: that one is fine
    if sizes and config.batch not in sizes:
        shapes = ", ".join(prof.accounting.input_shapes)
        prof = replace(prof, warnings=prof.warnings + (
            f"Config(batch={config.batch}) is no dimension of any input ({shapes}): the account is of the inputs "
            f"as given, and its per-example and per-token figures divide by {config.batch}; give Config(batch=N) "
            "with the inputs' batch",))
    return prof


def _profile_module(model: torch.nn.Module, args, kwargs: dict, config: Config,
                    inputs_for: Callable[[int], tuple] | None = None) -> Profile:
    """profile_module for a Config whose inputs were built for its batch (fxacct.profile's)."""
    prof = account_step(config, OneDevice(model, tuple(args), kwargs))
    if config.gpu is not None:
        prof = replace(prof, memory=_with_fit(prof.memory, model, config, inputs_for, prof.capture))
        prof = replace(prof, warnings=prof.warnings + _unsearched(prof.memory, config, inputs_for))
    if config.checkpoint:
        prof = replace(prof, checkpoint=_checkpoint_whatif(model, args, kwargs, config, prof, inputs_for))
    prof = _predicted(prof)
    if config.compiled:
        prof = replace(prof, compiled=_compile_whatif(model, args, kwargs, config, prof))
    return prof


def _one_device_notes(prof: Profile) -> Profile:
    """Flags of the mesh given on one device: accepted, and the report says they change nothing."""
    if prof.config.interconnect is None:
        return prof
    note = (f"--interconnect {prof.config.interconnect} has no effect on one device (no communication between "
            "GPUs): use it with --mesh and --gpu")
    return replace(prof, warnings=prof.warnings + (note,))


def _predicted(prof: Profile) -> Profile:
    """The roofline's step time on config.gpu (or a calibrated CPU), where one is known."""
    prof = replace(prof, prediction=predict_profile(prof))
    c, notes = prof.config, ()
    if c.gpu is None and c.sdpa_backend != "auto":
        notes += (f"--sdpa-backend {c.sdpa_backend} has no effect without --gpu (a CPU times attention as its "
                  "calibration measured it): use it with --gpu",)
    if c.gpu is None and c.mesh is not None and c.interconnect is not None:
        notes += (f"--interconnect {c.interconnect} has no effect without --gpu (the mesh's communication is "
                  "timed on a GPU's links only): use it with --gpu",)
    return replace(prof, warnings=prof.warnings + notes) if notes else prof


def _fitted_rank(prof: Profile, peak: int | None, basis: str) -> Profile:
    """A rank's peak against the GPU's capacity. No largest batch: under a mesh the batch is each
    rank's share of a global one, which ``fxacct plan`` searches."""
    if prof.config.gpu is None or peak is None:
        return prof
    notes = (NO_MESH_SEARCH,) if prof.config.find_max_batch else ()
    return replace(prof, memory=replace(prof.memory, fit=Fit.on(get_device(prof.config.gpu), peak, basis=basis)),
                   warnings=prof.warnings + notes)


NO_MESH_SEARCH = ("no largest batch under --mesh (each batch is a rank's share of a global one, a whole trace "
                  "of a rank's step): `fxacct plan --gpus N --global-batch B` searches layouts and micro-batches "
                  "(--no-max-batch silences this)")


def _pipeline(config: Config, build=profile_pipeline) -> Profile:
    """--mesh pp=P: stage 0's Profile (one micro-batch), carrying every rank's (PipelineAccount, from
    ``build``: fxacct's own stages, or a torchtitan job's); the fit holds the largest rank's peak over
    the whole step."""
    pipe = build(config).with_reserved()  # on a CUDA target each rank's step through the allocator
    first = pipe.stages[0].profile
    par = first.parallel  # the collectives of rank 0's step: its stage's, as the schedule drives FSDP2
    whole = dict(model_params=pipe.model_params, model_frozen_params=pipe.model_frozen_params)  # not stage 0's
    par = ParallelAccount(config.mesh, 0, (), (), pipeline=pipe, **whole) if par is None else replace(
        par, mesh=config.mesh, pipeline=pipe, rows=pipe.stages[0].collectives, **whole,
        throughput=pipeline_throughput(pipe, first.accounting.totals, config.mesh, config, first.capture.graph))
    prof = replace(first, config=config, parallel=par,
                   model_class=pipe.model_class)  # stage 0's module may be a cut of it (InterpreterModule)
    # stage 0's one micro-batch is not what a rank reserves: on a CUDA target the schedule's whole step
    # replayed through the allocator is, on the rank that needs the most of its GPU
    reserved = pipe.largest_reserved
    prof = replace(prof, memory=replace(prof.memory, reserved=reserved))
    if reserved is None:
        return _fitted_rank(prof, pipe.peak_bytes, "pipeline_peak_bytes")
    return _fitted_rank(prof, reserved.fit_bytes, "peak_reserved_bytes + fixed (the largest rank's step)")


def _checkpoint_whatif(model, args, kwargs, config: Config, prof: Profile, inputs_for) -> CheckpointWhatIf:
    """--checkpoint: the same step without the wrapping (a second capture, blocks replayed as
    usual), beside the checkpointed one."""

    def side(p: Profile):
        mem = p.memory
        return CheckpointSide(p.accounting.totals.activation_bytes, mem.rank_peak.bytes if mem.rank_peak else None,
                              p.accounting.totals.recompute_flops, mem.fit.max_batch if mem.fit is not None else None)

    plain = replace(config, checkpoint=(), checkpoint_policy=None)
    eager = account_step(plain, OneDevice(model, tuple(args), kwargs), with_inference=False)
    eager = replace(eager, memory=replace(prof.memory, peak_train=eager.memory.peak_train,
                                          per_rank=eager.memory.per_rank, fit=None, reserved=eager.memory.reserved))
    if config.gpu is not None:
        eager = replace(eager, memory=_with_fit(eager.memory, model, plain, inputs_for, eager.capture))
    return CheckpointWhatIf(config.checkpoint, tuple(matched_modules(model, config.checkpoint)),
                            config.checkpoint_policy, side(prof), side(eager))


def _compile_whatif(model, args, kwargs, config: Config, prof: Profile) -> CompileWhatIf:
    """--compile: the same step eager (a second capture), beside the compiled one."""
    eager = _predicted(account_step(replace(config, compile=False, compile_blocks=(), compile_mode="default"),
                                    OneDevice(model, tuple(args), kwargs), with_inference=False))
    graphs = prof.capture.compiled_graphs
    regions = tuple(name for name, _, _ in graphs)

    def inside(module: str) -> bool:
        return any(r == "" or module == r or module.startswith(r + ".") for r in regions)

    def step_ops(p: Profile, compiled_ops: bool):
        def keep(node) -> bool:
            cost = node.meta.get("fxacct")
            return (cost is not None and cost.phase in (FORWARD, BACKWARD)
                    and not (compiled_ops and inside(cost.module)))
        return fusion.kernels(p.capture.graph, fuse=False, keep=keep)

    def side(p: Profile, k) -> CompileSide:
        pred = None if p.prediction is None else p.prediction.step_ms  # compiled: the fused kernels' (predict_profile)
        peak = p.memory.rank_peak.bytes if p.memory.rank_peak is not None else None
        return CompileSide(p.accounting.totals.activation_bytes, peak, k.kernels, k.bytes_moved, pred,
                           {m.module: m.activation_bytes for m in p.accounting.modules})

    fused, rest = fusion.region_kernels(graphs), step_ops(prof, True)
    both = fusion.Kernels(fused.kernels + rest.kernels, fused.extern, fused.bytes_moved + rest.bytes_moved)
    return CompileWhatIf(regions, config.compile_mode, side(prof, both), side(eager, step_ops(eager, False)))


def _with_fit(memory, model, config: Config, inputs_for, cap: Capture) -> memory_account.MemoryAccount:
    """Headroom on the GPU, and the largest batch that fits: solved from traces and proven by a
    traced batch that fits beside the next one that does not (fxacct.memory.fit_search). ``cap``:
    the step's capture at config.batch; each batch tried is first where every storage's line
    through two traces reaches the capacity (fxacct.memory.fit_lines)."""
    device = get_device(config.gpu)
    need = memory.fit_bytes  # reserved + fixed on a CUDA target (MemoryAccount.fit_bytes)
    max_batch, verified = None, False
    # the search sizes a training step: a model of which nothing trains is fitted at its batch alone
    if config.find_max_batch and inputs_for is not None and memory.rank_peak is not None:
        traces = {config.batch: TracedFit.of(cap, lifetimes(cap))}  # no graph kept: a fit reads none
        guess = LineGuess(lambda b, traced, life: fit_of(replace(config, batch=b), traces[traced], model, life)[0],
                          device.capacity_reported)
        guess.add(config.batch, traces[config.batch].life)

        def bytes_at(batch: int) -> int:
            a, kw = inputs_for(batch)
            at = replace(config, batch=batch)
            traces[batch] = step_fit(at, OneDevice(model, tuple(a), kw))
            collect_dropped()  # the probe's graph: a fit keeps its lifetimes alone (fxacct.heap)
            guess.add(batch, traces[batch].life)
            return fit_of(at, traces[batch], model)[0]

        freeze_made()  # each probe's collection walks that probe alone (fxacct.heap)
        max_batch, verified, _ = largest_batch(bytes_at, config.batch, need, device.capacity_reported, guess=guess)
    return replace(memory, fit=Fit.on(device, need, max_batch, verified, memory.fit_basis))


def _unsearched(memory, config: Config, inputs_for) -> tuple[str, ...]:
    """Why a --gpu profile of a step that trains names no largest batch, where it would be searched:
    no ``inputs_for`` to build another batch's inputs (fxacct.profile_module called without one), or
    bytes that did not grow as the batch doubled (fxacct.memory.fit_search's flat case)."""
    if not config.find_max_batch or memory.rank_peak is None or memory.fit.max_batch is not None:
        return ()
    if inputs_for is None:
        return (f"the largest batch that fits on {config.gpu} is not searched: give profile_module "
                "inputs_for=lambda batch: (args, kwargs) to build another batch's inputs, or "
                "Config(find_max_batch=False)",)
    return (f"no largest batch on {config.gpu}: the step's bytes did not grow from batch {config.batch} to "
            f"{config.batch * 2 ** FLAT_DOUBLINGS} (the caching allocator's rounding and the fixed costs outweigh "
            "what a batch adds), so the capacity bounds no batch it traced",)


__all__ = ["Profile", "profile", "profile_module", "load_model"]
