"""Step time with communication: every collective timed by NCCL's own model
(fxacct.parallel.links), the ops put on the streams FSDP2 and c10d run them on, and the step
the critical path over those streams (fxacct.parallel.streams). Compute ops take their predicted
time (fxacct.predict.roofline)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fxacct.devices import get_device
from fxacct.parallel.links import collective_choice, links_for, nccl_bytes, placement
from fxacct.parallel.nccl_model import Group
from fxacct.parallel.streams import critical_path
from fxacct.predict.fused_time import predict_capture
from fxacct.predict.roofline import for_config, gpu_key, matmul_dtype
from fxacct.trace.dispatch_recorder import OPTIMIZER


@dataclass(frozen=True)
class ParallelTime:
    step_s: float  # the critical path over the streams
    compute_s: float  # the compute stream's ops other than collectives, one after another
    comm_s: float  # every collective, one after another
    links: str  # the source of the link figures
    gpus_per_node: int
    optimizer_s: float = 0.0  # the optimizer step's ops (on the compute stream, after the backward)
    streams: dict = field(default_factory=dict)  # stream -> seconds busy (fxacct.parallel.streams)
    interconnect: str | None = None  # the network between nodes (--interconnect or the GPU's node's)
    algorithms: dict = field(default_factory=dict)  # "ring/Simple" -> collectives NCCL runs so

    @property
    def exposed_comm_s(self) -> float:
        """What the step takes beyond the compute stream's own ops: collectives on the compute
        stream (tensor parallel) and whatever the side streams keep it waiting for."""
        return max(0.0, self.step_s - self.compute_s)


@dataclass(frozen=True)
class Throughput:
    """Tokens per second of one step. A tensor-parallel group of T GPUs runs one batch together
    (each rank's trace holds the group's tokens), so one GPU's share is the group's / T."""

    tokens_per_s_gpu: float | None
    tokens_per_s_tp_group: float | None  # the batch the tp group shares (= per GPU without tp)
    tokens_per_s_job: float | None  # every data-parallel replica
    mfu: float | None  # model FLOPs of the rank ÷ (step time × the GPU's dense peak in the matmuls' dtype)


def predict_time(profile_parts, spec, config, nodes):
    """(ParallelTime, {collective node: seconds}) on config.gpu, or (None, {}) without one."""
    if config.gpu is None:
        return None, {}
    cap, peak = profile_parts
    schedule, comm, algorithms, links, optimizer = step_schedule(cap, peak, spec, config, nodes)
    return ParallelTime(schedule.step_s, schedule.compute_s, sum(comm.values()), links.source, config.gpus_per_node,
                        optimizer, schedule.busy_s, links.network.name, algorithms), comm


def step_schedule(cap, peak, spec, config, nodes):
    """(Schedule, {collective node: seconds}, {"algorithm/protocol": count}, Links, optimizer
    seconds) of the traced rank's step on config.gpu."""
    links = links_for(gpu_key(config.gpu) or config.gpu, config.interconnect)
    groups = placement(spec, config.gpus_per_node)
    comm, algorithms = {}, {}
    for c in nodes:
        group = groups.get(c.mesh_dim) or Group(c.group_size, min(c.group_size, config.gpus_per_node))
        if group.ranks != c.group_size:  # a group the engine made itself: its own size
            group = Group(c.group_size, min(c.group_size, group.per_node))
        choice = collective_choice(c.op, group, nccl_bytes(c.op, c.bytes, c.wire_bytes), c.wire_bytes, links)
        comm[c.node] = choice.seconds
        if choice.protocol:
            key = f"{choice.algorithm}/{choice.protocol}"
            algorithms[key] = algorithms.get(key, 0) + 1
    predicted = predict_capture(cap, for_config(config), peak).ops  # --compile-blocks: fused kernels
    compute = {o.node: o.seconds for o in predicted if o.node not in comm}
    optimizer = sum(o.seconds for o in predicted if o.phase == OPTIMIZER and o.node not in comm)
    return critical_path(cap.graph, {**compute, **comm}), comm, algorithms, links, optimizer


def pipeline_throughput(pipe, totals, spec, config, graph: fx.Graph) -> Throughput:
    """Under pp: tokens per second and MFU of the whole step (pipe.step_s: every micro-batch through
    the schedule), not of stage 0's one micro-batch. A pipeline of pp × tp GPUs runs M micro-batches
    of ``totals.batch`` examples a step; the job has world ÷ (pp × tp) of them. MFU: every stage's
    model FLOPs (a rank's × tp) for each micro-batch, shared by the pipeline's GPUs; under
    interleaving a rank's account holds its first stage alone, so none."""
    if pipe.step_s is None or pipe.step_s <= 0 or config.gpu is None:
        return Throughput(None, None, None, None)
    tp_size, gpus = spec.size("tp"), spec.size("pp") * spec.size("tp")
    tokens = totals.batch * pipe.microbatches * totals.tokens_per_example if totals.tokens_per_example else None
    job = tokens / pipe.step_s * spec.world_size / gpus if tokens else None
    mfu = None
    if pipe.stages_per_rank == 1:
        flops = pipe.microbatches * tp_size * sum(s.profile.accounting.totals.model_flops for s in pipe.stages)
        mfu = flops / gpus / pipe.step_s / get_device(config.gpu).matmul_peak(matmul_dtype(graph))
    per_gpu = job / spec.world_size if job else None
    return Throughput(per_gpu, per_gpu * tp_size if per_gpu else None, job, mfu)


def throughput(time: ParallelTime | None, totals, spec, config, graph: fx.Graph) -> Throughput:
    """The step's tokens per second and MFU; the peak is the GPU's in the dtype the traced
    matmuls run in (fxacct.predict.roofline.matmul_dtype), whatever casts the parameters."""
    if time is None or time.step_s <= 0:
        return Throughput(None, None, None, None)
    tokens = totals.batch * totals.tokens_per_example if totals.tokens_per_example else None
    group = tokens / time.step_s if tokens else None
    tp_size = spec.size("tp")
    job = group * spec.world_size / tp_size if group else None
    peak = get_device(config.gpu).matmul_peak(matmul_dtype(graph))
    return Throughput(group / tp_size if group else None, group, job, totals.model_flops / time.step_s / peak)
