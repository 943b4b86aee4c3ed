"""Pipeline parallelism of a torchtitan job (``torchtitan:MODULE:CONFIG --mesh pp=P,...``), cut and
scheduled as torchtitan's ``pipeline_llm`` does (torchtitan/distributed/pipeline_parallel.py):

- the stages are the config's ``module_fqns_per_model_part``, or the ones ``_generate_llm_fqn_per_model_part``
  makes from ``_get_pipeline_metadata`` (its layers per stage, the embedding and the output weighted as
  layers); each is the whole model on meta cut by ``_split_module`` and parallelized on the rest of the
  mesh by the model spec's own ``parallelize_fn``, as pipeline_llm parallelizes each model part;
- the schedule is the config's ``pipeline_parallel_schedule`` (GPipe, 1F1B or Interleaved1F1B, torch's
  own; its stages per rank from the same metadata), over ``local_batch / pipeline_parallel_microbatch_size``
  micro-batches;
- each stage is traced for one micro-batch on rank 0 of the rest of the mesh: stage 0 takes the tokens,
  a later stage the hidden states the stage before it sends (requiring grad, so it sends their
  gradient back), the last one ends in torchtitan's loss as the schedule calls it; a stage before the
  last ends in the sum fxacct's own pipeline uses (its backward is the received gradient, no loss op).

The stages' accounts are then replayed in the schedule's order (fxacct.parallel.pipeline.assemble),
as for any ``--mesh pp=P``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fxacct.errors import UsageError, classify
from fxacct.load.mesh import parse_mesh, without_pp
from fxacct.load.torchtitan import adapted, job_config
from fxacct.parallel.accounts import PipelineAccount
from fxacct.parallel.engine import fake_group
from fxacct.parallel.pipeline import assemble
from fxacct.parallel.pipeline_schedule import check_microbatches
from fxacct.parallel.pipeline_split import StageInput
from fxacct.parallel.torchtitan import (
    TitanStep,
    account_rank,
    build_model,
    loss_of,
    optimizer_config,
    step_inputs,
    world_size,
)
from fxacct.trace.targets import cuda_sdpa

# torch.distributed.pipelining's schedule classes fxacct replays (fxacct.parallel.pipeline_schedule)
SCHEDULES = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved-1f1b"}
SCHEDULE_FIX = "override it after -- with --parallelism.pipeline_parallel_schedule 1F1B (or GPipe, Interleaved1F1B)"


def schedule_of(job) -> str:
    """fxacct's name of the job's pipeline schedule (torch's get_schedule_class resolves torchtitan's)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    par = job.parallelism
    if par.pipeline_parallel_schedule_csv:
        raise UsageError(f"a pipeline schedule read from a CSV ({par.pipeline_parallel_schedule_csv}) is not one fxacct "
                         f"replays; {SCHEDULE_FIX}")
    try:
        cls = get_schedule_class(par.pipeline_parallel_schedule)
    except ValueError:
        cls = None
    name = SCHEDULES.get(getattr(cls, "__name__", ""))
    if name is None:
        raise UsageError(f"torchtitan's pipeline schedule {par.pipeline_parallel_schedule!r} is not one fxacct replays "
                         f"(it replays torch's GPipe, 1F1B and Interleaved1F1B); {SCHEDULE_FIX}")
    return name


def job_schedule(config) -> str | None:
    """fxacct's name of the pipeline schedule ``config``'s torchtitan job would run, None where it
    is not one fxacct replays (fxacct plan then leaves pipeline layouts out)."""
    try:
        return schedule_of(job_config(replace(config, mesh=None)))
    except UsageError:
        return None


def stage_modules(job, pdims) -> list[list[str]]:
    """The module FQNs of each pipeline stage, as pipeline_llm chooses them."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _get_pipeline_metadata

    par = job.parallelism
    if par.module_fqns_per_model_part is not None:
        return [list(names) for names in par.module_fqns_per_model_part]
    virtual, layers, first, last = _get_pipeline_metadata(pdims, par, job.model_spec.model)
    return _generate_llm_fqn_per_model_part(virtual, layers, first, last)


def profile_torchtitan_pipeline(config) -> PipelineAccount:
    """Every rank's account of the torchtitan job ``config.target`` under ``--mesh pp=P,...``."""
    job = job_config(config)  # first: a usage error where torchtitan is missing
    from torchtitan.distributed.parallel_dims import ParallelDims

    par = job.parallelism
    inside = [d for d in ("tp", "cp", "ep") if config.mesh.size(d) > 1]
    if inside:  # docs/torchtitan.md, "Not yet"
        raise UsageError(f"--mesh {config.mesh}: {', '.join(inside)} inside torchtitan's pipeline stages is not accounted "
                         "yet (torch's pipelining defers FSDP2's gradient reductions, tensor parallelism's among them, "
                         "to the step's end, which a one-micro-batch trace does not show); use pp with fsdp and dp")
    ranks, micro = par.pipeline_parallel_degree, par.pipeline_parallel_microbatch_size
    m = job.training.local_batch_size // micro
    schedule = schedule_of(job)
    check_microbatches(schedule, ranks, m)
    world = world_size(job)
    step_config = replace(optimizer_config(job, config), pp_schedule=schedule)
    # a stage's trace is one micro-batch's
    stage_config = replace(step_config.stage(without_pp(config.mesh) or parse_mesh("fsdp=1")), batch=micro)
    with adapted(sdpa=cuda_sdpa if config.gpu is not None else None), fake_group(world):
        try:
            pdims = ParallelDims.from_config(par, world)
            pdims.world_mesh  # noqa: B018 (builds torchtitan's meshes: parallel_dims.py::build_mesh)
            job.model_spec.model.update_from_config(config=job)
            names = stage_modules(job, pdims)
        except UsageError:
            raise
        except Exception as e:
            raise classify(e, f"cutting {config.target} into pipeline stages with torchtitan") from e
        if len(names) % ranks:
            raise UsageError(f"--mesh {config.mesh}: torchtitan's {len(names)} pipeline stages do not divide among "
                             f"pp={ranks} ranks; give a pp that divides them")
        profs, received, sent, model_class = [], [], None, ""
        for s, modules in enumerate(names):
            prof, step = _stage(job, pdims, stage_config, s, len(names), modules, sent, config.target)
            received.append([StageInput(sent, s - 1)] if s else [])
            sent = step.sent
            profs.append(prof)
            model_class = model_class or type(step.model).__name__
    return assemble(step_config, profs, received, ranks, m, len(names) // ranks, model_class)


def _stage(job, pdims, config, s: int, stages: int, modules: list[str], received: torch.Tensor | None, target: str):
    """(stage s's Profile for one micro-batch, its TitanStep). ``received``: what the stage before sent."""
    last = s == stages - 1
    seq, micro = job.training.seq_len, job.parallelism.pipeline_parallel_microbatch_size
    try:
        part = build_model(job, pdims, modules)
        tokens, labels, extra = step_inputs(job, pdims, part, micro, seq)
        # the loss divides by the local batch's tokens (trainer.py: global_valid_tokens over all micro-batches)
        step = TitanStep(part, loss_of(job, part) if last else None, extra,
                         job.training.local_batch_size * seq, pipelined=True)
    except UsageError:
        raise
    except Exception as e:
        raise classify(e, f"building pipeline stage {s} of {target} with torchtitan") from e
    first = tokens if s == 0 else received
    if last:
        return account_rank(config, step, (first, labels), pdims), step
    return account_rank(replace(config, loss="sum", loss_output=None), step, (first,), pdims), step


__all__ = ["profile_torchtitan_pipeline", "schedule_of", "job_schedule", "stage_modules", "SCHEDULES"]
