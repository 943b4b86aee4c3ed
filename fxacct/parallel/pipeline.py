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
runtime holds memory (fxacct.parallel.pipeline_memory); send/recv volume per step is M × what
crosses each boundary (fxacct.parallel.pipeline.traffic: every tensor a later stage reads, and
the gradient of each that requires grad).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fxacct.devices import get_device
from fxacct.errors import UsageError, classify
from fxacct.load.mesh import without_pp
from fxacct.load.model_spec import call_user, check_call, resolve_function
from fxacct.load.source import load_model
from fxacct.memory.fixed import cublas_workspace_bytes, device_key, fixed_costs, outside_allocator
from fxacct.memory.reserved import ReservedAccount, communicators, fsdp_streams, rank_allocator, replayed, until_steady
from fxacct.parallel.accounts import PipelineAccount, StageAccount
from fxacct.parallel.engine import repeated_blocks
from fxacct.parallel.pipeline_collectives import rank_rows
from fxacct.parallel.pipeline_memory import AllocatorMirror, LocalStage, prepared_stages, stage_peak, stage_threads
from fxacct.parallel.pipeline_schedule import check_microbatches, per_rank, releases, simulate, step_seconds
from fxacct.parallel.pipeline_shape import same_figures, stage_shape
from fxacct.parallel.pipeline_split import (
    MODEL_INPUT,
    StageInput,
    block_costs,
    is_function,
    meta_like,
    split_points,
    stage_inputs,
    stage_module,
)
from fxacct.parallel.profile import profile_parallel
from fxacct.predict.fused_time import predict_profile
from fxacct.predict.roofline import for_config
from fxacct.step import OneDevice, account_step
from fxacct.trace import torch_private as tp


def _split(config, model, stage: int, stages: int, points=None, args=(), kwargs=None):
    """Stage ``stage``'s module: the user's --pp-split function's, or the model cut at ``points``."""
    if points is not None:
        return stage_module(model, args, kwargs or {}, points, stage)
    form = "fn(model, stage, stages)"
    fn = resolve_function(config.pp_split, "--pp-split", form)
    check_call(fn, "--pp-split", config.pp_split, form, model, stage, stages)
    try:
        part = call_user(fn, model, stage, stages)
    except Exception as e:
        raise classify(e, f"--pp-split {config.pp_split}") from e
    if not isinstance(part, torch.nn.Module):
        raise UsageError(f"--pp-split {config.pp_split} returned {type(part).__name__}, not the stage's nn.Module")
    return part


def resolve_points(config, stages: int, loader=load_model):
    """The FQNs where stages begin (None with a --pp-split function); automatic ones balance the
    repeated blocks' FLOPs in a one-device trace of the whole model."""
    if is_function(config.pp_split):
        return None
    model, args, kwargs, _ = loader(config)
    found = {id(b) for b in repeated_blocks(model)}
    blocks = [n for n, m in model.named_modules() if id(m) in found]

    def cost():
        one = replace(config.stage(None), optimizer="none")
        prof = account_step(one, OneDevice(model, args, kwargs), with_inference=False)
        return block_costs(prof.accounting, blocks)

    return split_points(model, config.pp_split, stages, cost)


def _stage_inputs(config, stages: int, points, loader=load_model) -> list[tuple[tuple, dict, list[StageInput]]]:
    """(args, kwargs, what it receives) per stage, on meta: stage 0 the model's inputs, a later
    stage the tensors it receives (several where the forward passes several: a Hugging Face Llama
    passes its hidden states with RoPE's cos and sin and the attention mask). A stage that reads
    from further back than the stage before (that Llama cut in three: cos, sin and the mask go
    from stage 0 to stage 2) is a skip connection torch's pipelining cannot run: refused."""
    def fresh():  # the model on meta in the step's dtype, and its inputs
        model, args, kwargs, _ = loader(config)
        if config.dtype is not None:
            model.to(config.dtype)
        return model, args, kwargs

    model, args, kwargs = fresh()
    if points is not None:
        received = stage_inputs(model, args, kwargs, points)
        for s, got in enumerate(received[2:], start=2):
            far = sorted({i.source for i in got if i.source not in (s - 1, MODEL_INPUT)})
            if far:
                raise UsageError(
                    f"pipeline stage {s} reads tensors made by stage {', '.join(map(str, far))}, not only by stage "
                    f"{s - 1}: torch.distributed.pipelining passes a stage's outputs to the next stage alone (a "
                    "PipelineStage cannot receive from further back, and Pipe.build_stage runs no backward through "
                    "such a skip connection); use fewer stages, or --pp-split PATH.py:fn whose stages pass along "
                    "what later ones read")
        return [(args, kwargs, [], None)] + [(tuple(i.tensor for i in r), {}, r, None) for r in received[1:]]
    parts, received, shapes = [], [], []  # --pp-split PATH.py:fn: each stage takes the previous one's outputs
    for s in range(stages):
        if s:  # a split function may cut the model it is given
            model, args, kwargs = fresh()
        part = _split(config, model, s, stages, None, args, kwargs)
        inputs, kw = (args, kwargs) if s == 0 else (tuple(i.tensor for i in received), {})
        parts.append((inputs, kw, received))
        shapes.append(stage_shape(part, inputs, kw, config.checkpoint))
        if s == stages - 1:  # the last stage's output goes to the loss: any form the loss takes
            break
        try:
            with torch.enable_grad():  # on meta: which outputs require grad (only those send a gradient back)
                out = part(*inputs, **kw)
        except Exception as e:  # the model's code raised (exit 3), or fxacct's (4): classify decides
            raise classify(e, f"running pipeline stage {s} on meta") from e
        received = [StageInput(meta_like(t), s) for t in tp.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not received:
            raise UsageError(f"pipeline stage {s} passes no tensor to the next stage ({type(out).__name__}): "
                             "a stage's forward returns what the next stage takes")
    return [(*part, shape) for part, shape in zip(parts, shapes)]


@dataclass(frozen=True)
class Traffic:
    """What one stage sends and receives per micro-batch (torch.distributed.pipelining: one
    send/recv per tensor; an activation forward to each stage that reads it, and its gradient
    back when it requires grad)."""

    sends: int
    send_bytes: int
    recvs: int
    recv_bytes: int
    grad_recv_bytes: int  # the gradients of its outputs it receives (PipelineStage's grad_recv_info)


def traffic(received: list[list[StageInput]], s: int) -> Traffic:
    fwd_recv = [i for i in received[s] if i.source != MODEL_INPUT]
    fwd_send = [i for later in received for i in later if i.source == s]
    bwd_send = [i for i in fwd_recv if i.tensor.requires_grad]
    bwd_recv = [i for i in fwd_send if i.tensor.requires_grad]
    sends, recvs = fwd_send + bwd_send, fwd_recv + bwd_recv
    return Traffic(len(sends), sum(i.nbytes for i in sends), len(recvs), sum(i.nbytes for i in recvs),
                   sum(i.nbytes for i in bwd_recv))


def profile_pipeline(config, loader=load_model, reuse_stages: bool = False):
    """The PipelineAccount of --mesh pp=P: one StageAccount per rank (its stages, V of them under
    interleaved 1F1B: stages r, r + P, ...), each stage traced for one micro-batch. ``loader``: as
    fxacct.parallel.profile.profile_parallel's (the planner's screen passes a truncated model).
    ``reuse_stages`` (the planner's, which reads figures only): stages of one shape (StageShape) are
    traced twice, and where the two accounts agree (same_figures) the later ones of that shape
    take the second's Profile, module names and all, instead of a trace of their own."""
    spec = config.mesh
    if spec.size("tp") > 1 and not is_function(config.pp_split):
        raise UsageError(f"--mesh {spec}: an automatic or FQN split cuts stages with torch.export (pipeline()), and "
                         "tensor parallelism cannot shard those traced graphs (their layers are no nn.Linear, their "
                         "reshapes fixed to every head); give --pp-split PATH.py:fn returning each stage as the "
                         "model's own modules, as torchtitan does (examples/llama.py:pipeline_stage)")
    if config.loss == "model":
        raise UsageError(f"--mesh {spec} with --loss model: a pipeline's stages are cut from the model's forward, "
                         "which computes its own loss from labels only as a whole; use --loss cross-entropy (the "
                         "same next-token loss, taken by fxacct on the last stage's logits)")
    ranks, m = spec.size("pp"), config.microbatches or spec.size("pp")
    v = per_rank(config.pp_schedule, config.pp_stages_per_rank)
    stages = ranks * v
    whole = loader(config)[0]
    blocks = len(repeated_blocks(whole))
    asked = f"pp={ranks}" + (f" with {v} stages per rank" if v > 1 else "")
    if blocks == 0 and not config.pp_split:  # the automatic split cuts between repeated blocks
        raise UsageError(f"--mesh {asked}: the model has no repeated blocks to cut between automatically; give "
                         "--pp-split FQN,... (the modules where stages 1, 2, ... begin) or --pp-split PATH.py:fn")
    if blocks and stages > blocks:
        fix = f"use pp <= {blocks // v}" if blocks // v >= 2 else \
            f"use --pp-stages-per-rank {blocks // ranks} or --pp-schedule 1f1b" if blocks // ranks >= 2 else \
            "use --pp-schedule 1f1b" if blocks >= ranks else f"use pp <= {blocks}"
        raise UsageError(f"--mesh {asked} asks for more pipeline stages than the model has repeated blocks "
                         f"({blocks}): {fix}")
    check_microbatches(config.pp_schedule, ranks, m)
    points = resolve_points(config, stages, loader)
    parts = _stage_inputs(config, stages, points, loader)
    profs = _profile_stages(config, stages, points, parts, loader, reuse_stages)  # (parts as stages sent)
    return assemble(config, profs, [r for _, _, r, _ in parts], ranks, m, v, type(whole).__name__,
                    (sum(t.numel() for t in whole.parameters()),
                     sum(t.numel() for t in whole.parameters() if not t.requires_grad)))


def assemble(config, profs: list, received: list[list[StageInput]], ranks: int, m: int, v: int,
             model_class: str, model_params: tuple[int, int] | None = None) -> PipelineAccount:
    """The PipelineAccount of stages traced for one micro-batch each (``profs``, in stage order;
    ``received``: what each stage receives), run by ``config.pp_schedule`` over ``ranks`` ranks with
    ``m`` micro-batches and ``v`` stages per rank: each rank's peak, collectives and traffic, and
    on a CUDA target what replays each rank's step through the caching allocator
    (PipelineAccount.with_reserved: a layout's screen or one over memory at its peak needs none).
    ``model_params``: (parameters, frozen ones) of the whole model; else the stages' summed."""
    if model_params is None:
        pars = [p.parallel for p in profs]
        model_params = (sum(p.model_params or 0 for p in pars if p is not None),
                        sum(p.model_frozen_params for p in pars if p is not None))
    orders = simulate(config.pp_schedule, ranks, m, v)
    flows = [traffic(received, s) for s in range(len(profs))]
    local = [_local_stages(profs, flows, r, ranks) for r in range(ranks)]
    accounts = tuple(_rank_account(config, profs, flows, local[r], r, ranks, m, orders[r]) for r in range(ranks))
    bubble = max(1 - o.busy / o.span for o in orders)
    replay, fixed = None, 0
    if config.gpu is not None:
        fixed = outside_allocator(fixed_costs(device_key(config.gpu), communicators(config.mesh)))

        def replay():
            return tuple(_rank_reserved(config, local[r], orders[r], ranks, r, m) for r in range(ranks))
    return PipelineAccount(accounts, config.pp_schedule, m, bubble, v, model_class,
                           _step_seconds(config, profs, ranks, m, v), fixed, replay, *model_params)


def _step_seconds(config, profs, ranks: int, m: int, v: int) -> float | None:
    """The whole step on the device the config predicts for (PipelineAccount.step_s), or None."""
    device = for_config(config)
    if device is None:
        return None
    phases = [predict_profile(p, device).by_phase for p in profs]
    span = step_seconds(config.pp_schedule, ranks, m, v, [ph["forward"] + ph["loss"] for ph in phases],
                        [ph["backward"] for ph in phases])
    optimizer = max(sum(phases[s]["optimizer"] for s in range(r, len(profs), ranks)) for r in range(ranks))
    return span + optimizer


def _profile_stages(config, stages: int, points, parts, loader, reuse: bool) -> list:
    """Each stage's Profile (profile_pipeline's ``reuse_stages``: a proven shape's later stages reuse).
    ``parts`` (per stage: args, kwargs, what it receives, its shape) were found on the model before
    it was parallelized; a stage that sends one tensor sends what its traced step output, which
    the parallelized stage may have made smaller (sequence parallelism hands the next block a
    sequence shard): the next stage receives that (``parts`` is updated in place)."""
    profs, seen, proven = [], {}, {}
    for s in range(len(parts)):
        if s:
            parts[s] = _as_sent(parts[s], profs[s - 1], s - 1)
        args, kwargs, _, shape = parts[s]
        key = (shape, s == stages - 1)
        done = seen.get(key, []) if reuse and shape is not None else []
        if len(done) >= 2 and proven[key]:
            profs.append(done[-1])
            continue
        prof = _profile_stage(config, s, stages, points, args, kwargs, loader)
        if reuse and shape is not None:
            seen.setdefault(key, []).append(prof)
            if len(seen[key]) == 2:
                proven[key] = same_figures(*seen[key])
        profs.append(prof)
    return profs


def _as_sent(part, sender, source: int):
    """Stage ``part`` receiving the one tensor its sender's traced step output (its local shard,
    dtype, requires_grad), where the split on the unparallelized model found another shape."""
    args, kwargs, received, shape = part
    sent = sender.capture.output_metas
    if kwargs or len(received) != 1 or len(sent) != 1 or received[0].source != source or len(args) != 1:
        return part
    (size, dtype, grad), got = sent[0], received[0].tensor
    if (tuple(got.shape), got.dtype) == (size, dtype):
        return part
    tensor = torch.empty(size, dtype=dtype, device="meta").requires_grad_(grad and dtype.is_floating_point)
    return (tensor,), kwargs, [StageInput(tensor, source)], shape


def _profile_stage(config, s: int, stages: int, points, args, kwargs, loader=load_model):
    """Stage s's Profile for one micro-batch (on the rest of the mesh, if any)."""
    # a received activation requires grad where the stage that made it gave it one (StageInput)
    cfg = config.stage(without_pp(config.mesh))
    if s < stages - 1:  # the loss is the last stage's; an earlier one receives its output's gradient
        cfg = replace(cfg, loss="sum", loss_output=None)  # (a sum's backward: a gradient, no loss op)

    def load_stage(c):
        model, full_args, full_kwargs, _ = loader(c)
        return _split(config, model, s, stages, points, full_args, full_kwargs), args, kwargs, None

    if cfg.mesh is not None:
        return profile_parallel(cfg, load_stage)
    model, _, _, _ = load_stage(cfg)
    return account_step(cfg, OneDevice(model, args, kwargs))


def _local_stages(profs, flows: list[Traffic], r: int, ranks: int) -> dict:
    """Rank r's stages r, r + P, ...: stage index -> LocalStage."""
    local = {}
    for s in range(r, len(profs), ranks):
        par = profs[s].parallel
        local[s] = LocalStage(profs[s].capture, s == len(profs) - 1, flows[s].grad_recv_bytes,
                              par.resizes if par is not None else ())
    return local


def _rank_account(config, profs, flows: list[Traffic], local: dict, r: int, ranks: int, m: int, order) -> StageAccount:
    """Rank r's stages (``local``): their peak replayed together, their sends and receives."""
    mine = [flows[s] for s in local]
    peak = stage_peak(local, order.actions, m, releases(config.pp_schedule, order.actions, ranks, r, m))
    collectives = rank_rows({s: profs[s].parallel for s in local}, order.actions, m)
    totals = [profs[s].accounting.totals for s in local]
    return StageAccount(r, profs[r], order.in_flight, peak, m * sum(f.send_bytes for f in mine),
                        m * sum(f.recv_bytes for f in mine), tuple(local), m * sum(f.sends for f in mine),
                        m * sum(f.recvs for f in mine), collectives, params=sum(t.params for t in totals),
                        param_bytes=sum(t.param_bytes for t in totals))


def _rank_reserved(config, local: dict, order, ranks: int, r: int, m: int) -> ReservedAccount:
    """Rank r's run, its step walked again in the schedule's order for each of the run's steps,
    through the caching allocator of config.gpu; the rank joins a process group for each mesh
    dimension, pp's included."""
    gpu, conf = device_key(config.gpu), config.allocator_conf()
    prep = prepared_stages(local, m)
    threads = stage_threads(prep)
    allocator, fixed = rank_allocator(gpu, get_device(config.gpu).capacity_reported, conf, communicators(config.mesh),
                                      threads)
    mirror = AllocatorMirror(allocator, {s: fsdp_streams(st.capture.graph) for s, st in local.items()},
                             cublas_workspace_bytes(gpu), threads)
    released = releases(config.pp_schedule, order.actions, ranks, r, m)

    def run_step(step: int) -> None:  # a run's step (fxacct.memory.reserved)
        stage_peak(local, order.actions, m, released, mirror, prep)
        mirror.end_step()

    until_steady(allocator, run_step)
    return replayed(allocator, fixed, conf)
