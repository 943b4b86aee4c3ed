"""The mesh and the collectives of one rank (``--mesh``): a text section and the JSON keys
``mesh``, ``collectives`` and ``totals.comm_wire_bytes``."""

from __future__ import annotations

from fxacct.report.width import fit_table, wrap_lines
from fxacct.units import format_bytes


def mesh_json(parallel) -> dict:
    return {"dims": {name: size for name, size in parallel.mesh.dims}, "world_size": parallel.mesh.world_size,
            "rank": parallel.rank, "model_params": parallel.model_params}


def collectives_json(parallel) -> list[dict]:
    return [{"op": r.op, "mesh_dim": r.mesh_dim, "phase": r.phase, "module": r.module, "count": r.count,
             "bytes": r.bytes, "wire_bytes": r.wire_bytes, "predicted_ms": r.predicted_ms}
            for r in parallel.rows]


def pipeline_json(pipe) -> dict:
    return {"schedule": pipe.schedule, "microbatches": pipe.microbatches, "bubble_fraction": pipe.bubble_fraction,
            "stages_per_rank": pipe.stages_per_rank,
            "step_ms": None if pipe.step_s is None else 1e3 * pipe.step_s,
            "stages": [{"stage": s.stage, "stages_on_rank": list(s.stages_on_rank), "in_flight_microbatches": s.in_flight, "peak_bytes": s.peak_bytes,
                        "one_microbatch_peak_bytes": s.profile.memory.peak_train.bytes,
                        "activation_bytes": s.profile.accounting.totals.activation_bytes,
                        "params": s.params, "param_bytes": s.param_bytes,
                        "forward_flops": s.profile.accounting.totals.forward.total,
                        "backward_flops": s.profile.accounting.totals.backward.total,
                        "send_bytes": s.send_bytes, "recv_bytes": s.recv_bytes, "sends": s.sends, "recvs": s.recvs,
                        # on a CUDA target: the rank's step through the caching allocator, plus the fixed costs
                        "peak_reserved_bytes": s.reserved.peak_reserved_bytes if s.reserved is not None else None,
                        "fit_bytes": s.reserved.fit_bytes if s.reserved is not None else None}
                       for s in pipe.stages]}


def render_pipeline(pipe, width: int | None = None) -> str:
    rows = [[str(s.stage), f"{s.params:,}",
             f"{s.profile.accounting.totals.forward.total + s.profile.accounting.totals.backward.total:,}",
             format_bytes(s.profile.memory.peak_train.bytes), str(s.in_flight), format_bytes(s.peak_bytes),
             format_bytes(s.send_bytes), format_bytes(s.recv_bytes)] for s in pipe.stages]
    head = ["stage" if pipe.stages_per_rank == 1 else "rank", "params", "FLOPs / mb", "peak, 1 mb",
            "in flight", "peak", "send / step", "recv / step"]
    layout = f"{len(pipe.stages)} stages" if pipe.stages_per_rank == 1 else \
        f"{len(pipe.stages)} ranks × {pipe.stages_per_rank} stages (params: all the rank's stages'; FLOPs and " \
        "1-micro-batch peak: its first stage's)"
    return "\n".join([f"pipeline: {layout}, {pipe.microbatches} micro-batches, {pipe.schedule}; "
                      f"bubble {pipe.bubble_fraction:.1%} (the report above is stage 0's, one micro-batch; "
                      "mb: micro-batch)",
                      fit_table(head, rows, width, optional=(1, 3, 2))])


def add_to_document(doc: dict, parallel) -> dict:
    """The --mesh keys added to a profile document (nothing changes for a single device)."""
    if parallel is not None and parallel.pipeline is not None:
        doc["pipeline"] = pipeline_json(parallel.pipeline)
    if parallel is not None:
        doc["config"]["world_size"] = parallel.mesh.world_size  # the ranks (GPUs) of the job
        doc["config"]["mesh"] = str(parallel.mesh)
        doc["mesh"] = mesh_json(parallel)
        doc["collectives"] = collectives_json(parallel)
        doc["totals"]["comm_wire_bytes"] = parallel.comm_wire_bytes
        t, th = parallel.time, parallel.throughput
        if t is not None:  # the critical path over compute and communication is the step time
            doc["totals"]["predicted_step_ms"] = 1e3 * t.step_s
            doc["mesh"]["time"] = {
                "step_ms": 1e3 * t.step_s, "compute_ms": 1e3 * t.compute_s, "comm_ms": 1e3 * t.comm_s,
                "exposed_comm_ms": 1e3 * t.exposed_comm_s, "gpus_per_node": t.gpus_per_node, "links": t.links,
                "interconnect": t.interconnect, "streams_ms": {k: 1e3 * v for k, v in t.streams.items()},
                "nccl_algorithms": dict(t.algorithms),
                "tokens_per_s_gpu": th.tokens_per_s_gpu,
                "tokens_per_s_tp_group": th.tokens_per_s_tp_group, "tokens_per_s_job": th.tokens_per_s_job, "mfu": th.mfu}
    return doc


def render_collectives(parallel, width: int | None = None) -> str:
    """op × mesh dim × phase: count, output-buffer bytes and wire bytes this rank sends; tables fit
    ``width`` (fxacct.report.width.fit_table: optional columns left out, numbers never cut)."""
    table: dict[tuple, list[int]] = {}
    for r in parallel.rows:
        acc = table.setdefault((r.op, r.mesh_dim, r.phase), [0, 0, 0])
        acc[0] += r.count
        acc[1] += r.bytes
        acc[2] += r.wire_bytes
    n = parallel.mesh.world_size
    lines = [f"mesh {parallel.mesh} ({n} rank{'s' if n != 1 else ''}); figures are rank {parallel.rank}'s "
             "(parameters, gradients, optimizer state, activations and peaks above are per rank)"]
    if parallel.pipeline is not None:
        lines.append(render_pipeline(parallel.pipeline, width))
    if not table:
        return "\n".join(lines + ["collectives: none"])
    timed = parallel.time is not None
    ms = {}
    for r in parallel.rows:
        ms[(r.op, r.mesh_dim, r.phase)] = ms.get((r.op, r.mesh_dim, r.phase), 0.0) + (r.predicted_ms or 0.0)
    rows = [[op, dim, phase, f"{n:,}", format_bytes(b), format_bytes(w)] + ([f"{ms[(op, dim, phase)]:.3f}"] if timed else [])
            for (op, dim, phase), (n, b, w) in table.items()]
    total = [sum(v[i] for v in table.values()) for i in range(3)]
    rows.append(["total", "", "", f"{total[0]:,}", format_bytes(total[1]), format_bytes(total[2])]
                + ([f"{sum(ms.values()):.3f}"] if timed else []))
    lines += ["collectives of one step (wire: what this rank sends, ring algorithms):",
              fit_table(["op", "mesh dim", "phase", "count", "buffer bytes", "wire bytes"]
                        + (["predicted ms"] if timed else []), rows, width, optional=(4,))]
    return "\n".join(lines + _time_lines(parallel))


def _time_lines(parallel) -> list[str]:
    t, th = parallel.time, parallel.throughput
    if t is None:
        return ["communication time: give --gpu NAME (links by GPU, --gpus-per-node)"]
    lines = [f"step time with communication (critical path of compute and communication streams): "
             f"{1e3 * t.step_s:.3f} ms; compute {1e3 * t.compute_s:.3f} ms, communication {1e3 * t.comm_s:.3f} ms, "
             f"of it exposed {1e3 * t.exposed_comm_s:.3f} ms ({t.gpus_per_node} GPUs per node: {t.links})"]
    if t.streams:
        busy = ", ".join(f"{name.replace('_', '-')} {1e3 * s:.3f} ms" for name, s in t.streams.items())
        algos = ", ".join(f"{k} ×{n}" for k, n in t.algorithms.items())
        lines.append(f"streams busy: {busy}; NCCL's picks: {algos or 'none'}; between nodes: {t.interconnect}")
    if th.tokens_per_s_gpu is not None:
        group = (f", {th.tokens_per_s_tp_group:,.0f} per tp group" if th.tokens_per_s_tp_group != th.tokens_per_s_gpu
                 else "")
        lines.append(f"tokens/s: {th.tokens_per_s_gpu:,.0f} per GPU{group}, {th.tokens_per_s_job:,.0f} for the job; "
                     f"MFU {th.mfu:.1%}")
    elif th.mfu is not None:
        lines.append(f"MFU {th.mfu:.1%}")
    return lines


def _by_op(rows) -> dict[str, list[int]]:
    by: dict[str, list[int]] = {}
    for r in rows:
        acc = by.setdefault(r.op, [0, 0])
        acc[0] += r.count
        acc[1] += r.bytes
    return by


def _predicted_for(parallel, rank: int) -> dict[str, list[int]]:
    """Collectives by op: rank 0's account for every rank; under pp its pipeline rank's step (the
    collectives of the rest of the mesh, and its stages' send/recv)."""
    pipe = parallel.pipeline
    if pipe is None:
        return _by_op(parallel.rows)
    s = pipe.stages[_pipeline_rank(parallel, rank)]
    by = _by_op(s.collectives)
    by.update({op: [n, b] for op, n, b in (("send", s.sends, s.send_bytes), ("recv", s.recvs, s.recv_bytes)) if n})
    return by


def _pipeline_rank(parallel, rank: int) -> int:
    """A global rank's coordinate on pp, the outermost mesh dim (ranks are numbered row-major)."""
    return rank // (parallel.mesh.world_size // parallel.mesh.size("pp"))


def _peak_for(parallel, rank: int, predicted_peak: int | None) -> int | None:
    """Rank 0's peak for every rank; under pp the rank's stage's, with its in-flight micro-batches."""
    pipe = parallel.pipeline
    return pipe.stages[_pipeline_rank(parallel, rank)].peak_bytes if pipe is not None else predicted_peak


def ranks_json(parallel, ranks, predicted_peak: int | None) -> list[dict]:
    """Per rank of the real run: measured beside predicted (rank 0's account stands for every rank);
    a torchtitan MoE job's router counts as ``expert_load``, in the form --expert-load reads."""
    return [{"rank": m.rank, "step_ms": m.step_ms, "op_level_peak_bytes": m.op_level_peak_bytes,
             "predicted_peak_bytes": _peak_for(parallel, m.rank, predicted_peak),
             "collectives": {op: {"count": c, "bytes": b, "predicted_count": _predicted_for(parallel, m.rank).get(op, [0, 0])[0],
                                  "predicted_bytes": _predicted_for(parallel, m.rank).get(op, [0, 0])[1]}
                             for op, (c, b) in sorted(m.collectives.items())},
             **({"expert_load": {"layers": m.expert_load}} if m.expert_load else {})}
            for m in ranks]


def render_ranks(parallel, ranks, predicted_peak: int | None, width: int | None = None) -> str:
    """The real gloo run, rank by rank: op-level peak and collectives, measured / predicted; the
    table fits ``width`` (the step time is left out first)."""
    ops = sorted({op for m in ranks for op in m.collectives} | {op for m in ranks for op in _predicted_for(parallel, m.rank)})
    rows = []
    for m in ranks:
        predicted, pk = _predicted_for(parallel, m.rank), _peak_for(parallel, m.rank, predicted_peak)
        cells = [str(m.rank), f"{m.step_ms:.1f}", format_bytes(m.op_level_peak_bytes),
                 f"{m.op_level_peak_bytes / pk:.3f}" if pk else "n/a"]
        for op in ops:
            c, b = m.collectives.get(op, [0, 0])
            pc, pb = predicted.get(op, [0, 0])
            cells.append(f"{c}/{pc} {format_bytes(b)}" + ("" if (c, b) == (pc, pb) else " (differs)"))
        rows.append(cells)
    head = ["rank", "step ms", "op-level peak", "measured/predicted"] + list(ops)
    whose = "each rank's pipeline rank" if parallel.pipeline is not None else "rank 0's account"
    lines = [wrap_lines(f"real run: {len(ranks)} CPU processes on gloo, mesh {parallel.mesh} (predicted: "
                        f"{whose}); per collective: measured count/predicted count, measured bytes", width),
             fit_table(head, rows, width, optional=(1,))]
    over = any(m.op_level_peak_bytes > _peak_for(parallel, m.rank, predicted_peak) for m in ranks
               if _peak_for(parallel, m.rank, predicted_peak))
    if over and any(op == "reduce_scatter" for m in ranks for op in m.collectives):
        lines.append(wrap_lines(GLOO_REDUCE_SCATTER, width))
    return "\n".join(lines)


# docs/limits.md; measured: the same eager step on the fake process group peaks at the prediction
GLOO_REDUCE_SCATTER = ("note: gloo reduce-scatters through an all-reduce of a full copy of its input, so while one "
                       "runs a rank holds a whole unit's gradients in the reduce dtype; NCCL, and the account, "
                       "reduce into the shard. A peak that falls there measures over the prediction on gloo only.")
