"""Pipeline parallelism (``--mesh pp=P,...``): the model is cut into stages
(fxacct.parallel.pipeline_split: the user's ``--pp-split PATH.py:fn``, FQNs where stages begin,
or blocks balanced by traced FLOPs), each stage traced for one micro-batch (on the rest of the
mesh, if any; stages after the first take the previous stage's output and compute the gradient
of it, which they send back), and rank r accounted with its stages (r; r, r + P, ... under
interleaved 1F1B). The schedule's own per-rank order (fxacct.parallel.pipeline_schedule:
torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) says how
many micro-batches each rank holds at once and how long it idles:

- GPipe runs every forward before any backward: each stage holds all M micro-batches.
- 1F1B starts stage s (0-based) with P − s forwards, then alternates one backward and one
  forward: stage s holds at most min(P − s, M) micro-batches (the first stage P).
- Both idle (P − 1) of (M + P − 1) slots per stage: the bubble fraction (Huang et al. 2019,
  GPipe; Narayanan et al. 2021, PipeDream-Flush / 1F1B); interleaving V stages per rank makes
  it (P − 1) of (V·M + P − 1) (Narayanan et al. 2021).

A rank's peak is its stages' one-micro-batch steps replayed in that order as the pipelining
runtime holds memory (fxacct.parallel.pipeline_memory); send/recv volume per step is M × the
boundary tensor each way, per stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fxacct.errors import UsageError, classify
from fxacct.parallel.engine import repeated_blocks
from fxacct.parallel.mesh import parse_mesh, without_pp
from fxacct.parallel.pipeline_memory import LocalStage, stage_peak
from fxacct.parallel.pipeline_schedule import check_microbatches, per_rank, releases, simulate
from fxacct.parallel.pipeline_split import block_costs, is_function, split_points, stage_module


@dataclass(frozen=True)
class StageAccount:
    stage: int  # the rank's index in the pipeline (its first stage)
    profile: object  # fxacct.Profile of one micro-batch on this rank's first stage
    in_flight: int  # micro-batches whose activations the stage holds at once
    peak_bytes: int  # the step replayed in the schedule's order (fxacct.parallel.pipeline_memory)
    send_bytes: int  # per step: activations forward + input gradients backward
    recv_bytes: int
    stages_on_rank: tuple[int, ...] = ()  # the pipeline stages this rank runs (r, r + P, ... interleaved)


@dataclass(frozen=True)
class PipelineAccount:
    stages: tuple[StageAccount, ...]
    schedule: str
    microbatches: int
    bubble_fraction: float  # idle share of the step on a rank, from the schedule's order
    stages_per_rank: int = 1


def _split(config, model, stage: int, stages: int, points=None, args=(), kwargs=None):
    """Stage ``stage``'s module: the user's --pp-split function's, or the model cut at ``points``."""
    from fxacct.load.model_spec import call_user, resolve

    if points is not None:
        return stage_module(model, args, kwargs or {}, points, stage)
    fn, _ = resolve(config.pp_split)
    try:
        part = call_user(fn, model, stage, stages)
    except Exception as e:
        raise classify(e, f"--pp-split {config.pp_split}") from e
    if not isinstance(part, torch.nn.Module):
        raise UsageError(f"--pp-split {config.pp_split} returned {type(part).__name__}, not the stage's nn.Module")
    return part


def resolve_points(config, stages: int):
    """The FQNs where stages begin (None with a --pp-split function); automatic ones balance the
    repeated blocks' FLOPs in a one-device trace of the whole model."""
    from fxacct.profile import load_model, profile_module

    if is_function(config.pp_split):
        return None
    model, args, kwargs, _ = load_model(config)
    found = {id(b) for b in repeated_blocks(model)}
    blocks = [n for n, m in model.named_modules() if id(m) in found]

    def cost():
        prof = profile_module(model, args, kwargs, replace(config, mesh=None, optimizer="none"))
        return block_costs(prof.accounting, blocks)

    return split_points(model, config.pp_split, stages, cost)


def _stage_inputs(config, stages: int, points):
    """(args, kwargs) per stage on meta: each stage's input is the previous one's output."""
    from fxacct.profile import load_model

    parts, x = [], None
    for s in range(stages):
        model, args, kwargs, _ = load_model(config)
        if config.dtype is not None:
            model.to(config.dtype)
        part = _split(config, model, s, stages, points, args, kwargs)
        inputs = args if s == 0 else (x,)
        parts.append((inputs, kwargs if s == 0 else {}))
        if s == stages - 1:  # the last stage's output goes to the loss: any form the loss takes
            break
        try:
            with torch.no_grad():
                out = part(*inputs, **(kwargs if s == 0 else {}))
        except Exception as e:  # the model's code raised (exit 3), or fxacct's (4): classify decides
            raise classify(e, f"running pipeline stage {s} on meta") from e
        if not isinstance(out, torch.Tensor):
            n = len(out) if isinstance(out, (tuple, list)) else 1
            raise UsageError(f"pipeline stage {s} passes {n} values ({type(out).__name__}) to the next stage; the "
                             "pipeline account takes one tensor between stages: split where the forward passes one")
        x = torch.empty(out.shape, dtype=out.dtype, device="meta")
    return parts


def profile_pipeline(config):
    """The PipelineAccount of --mesh pp=P: one StageAccount per rank (its stages, V of them under
    interleaved 1F1B: stages r, r + P, ...), each stage traced for one micro-batch."""
    from fxacct.profile import load_model

    spec = parse_mesh(config.mesh)
    ranks, m = spec.size("pp"), config.microbatches or spec.size("pp")
    v = per_rank(config.pp_schedule, config.pp_stages_per_rank)
    stages = ranks * v
    blocks = len(repeated_blocks(load_model(config)[0]))
    if stages > blocks:
        asked = f"pp={ranks}" + (f" with {v} stages per rank" if v > 1 else "")
        raise UsageError(f"--mesh {asked} asks for more pipeline stages than the model has repeated blocks "
                         f"({blocks}): use pp <= {blocks // v}")
    check_microbatches(config.pp_schedule, ranks, m)
    orders = simulate(config.pp_schedule, ranks, m, v)
    points = resolve_points(config, stages)
    profs = [_profile_stage(config, s, stages, points, args, kwargs)
             for s, (args, kwargs) in enumerate(_stage_inputs(config, stages, points))]
    accounts = tuple(_rank_account(profs, r, ranks, m, orders[r], config.pp_schedule) for r in range(ranks))
    bubble = max(1 - o.busy / o.span for o in orders)
    return PipelineAccount(accounts, config.pp_schedule, m, bubble, v)


def _profile_stage(config, s: int, stages: int, points, args, kwargs):
    """Stage s's Profile for one micro-batch (on the rest of the mesh, if any)."""
    from fxacct.profile import load_model, profile_module

    cfg = replace(config, mesh=without_pp(parse_mesh(config.mesh)), input_requires_grad=config.input_requires_grad or s > 0)

    def loader(c):
        model, full_args, full_kwargs, _ = load_model(c)
        return _split(c, model, s, stages, points, full_args, full_kwargs), args, kwargs, None

    if cfg.mesh is not None:
        from fxacct.parallel.profile import profile_parallel

        return profile_parallel(cfg, loader)
    model, _, _, _ = loader(cfg)
    return profile_module(model, args, kwargs, replace(cfg, mesh=None))


def _rank_account(profs, r: int, ranks: int, m: int, order, schedule: str) -> StageAccount:
    """Rank r's stages r, r + P, ...: their peak replayed together, their sends and receives."""
    local, send = {}, 0
    for s in range(r, len(profs), ranks):
        prof = profs[s]
        boundary_in = prof.capture.input_nodes[0].meta["val"].storage_nbytes if s > 0 else 0
        boundary_out = _output_bytes(prof) if s < len(profs) - 1 else 0
        local[s] = LocalStage(prof.capture, s == len(profs) - 1, boundary_out)
        send += m * (boundary_out + boundary_in)
    peak = stage_peak(local, order.actions, m, releases(schedule, order.actions, ranks, r, m))
    return StageAccount(r, profs[r], order.in_flight, peak, send, send, tuple(local))


def _output_bytes(prof) -> int:
    """Bytes of the stage's output: the loss phase's first op reads it (fxacct.trace.loss)."""
    for n in prof.capture.graph.nodes:
        cost = n.meta.get("fxacct")
        if cost is not None and cost.phase == "loss" and n.all_input_nodes:
            val = n.all_input_nodes[0].meta.get("val")
            return val.nbytes if hasattr(val, "nbytes") else 0
    return 0
