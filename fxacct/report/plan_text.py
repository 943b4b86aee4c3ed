"""The table of ``fxacct plan``: layouts that fit, by predicted throughput, then the others with
why. One line per layout, fitted to the width (fxacct.report.width)."""

from __future__ import annotations

from fxacct.report.width import fit_table, wrap_lines
from fxacct.units import format_bytes

HEADERS = ["#", "mesh", "mb", "×mb", "ckpt", "mem/GPU", "step ms", "tokens/s", "MFU", "from", "verdict"]
LEGEND = ("mb: micro-batch per rank; ×mb: micro-batches per step; ckpt job: the job's own checkpointing; mem/GPU: "
          "what a rank needs, as fxacct check --gpu judges it (the allocator's reserved peak plus the CUDA context "
          "and NCCL's buffers; under pp the largest rank's); tokens/s: the job's; from: a full trace or the "
          "screen (two short traces, extrapolated)")
SOURCES = {"traced": "trace", "screen": "screen", "-": "-"}
PLAN_SCHEMA = "fxacct.plan/1"


def _ckpt(checkpoint: bool | None) -> str:
    """on, off, or "job": a torchtitan job's own activation checkpointing, as its config says."""
    return "job" if checkpoint is None else "on" if checkpoint else "off"


def _row(i: int, c) -> list[str]:
    lay = c.layout
    verdict = "fits" if c.fits else (c.dominated or c.rejected)
    return [str(i + 1) if c.fits else "-", lay.mesh, str(lay.micro_batch) if lay.micro_batch else "-",
            str(lay.accumulation) if lay.accumulation else "-", _ckpt(lay.checkpoint) if lay.micro_batch else "-",
            format_bytes(c.fit_bytes) if c.fit_bytes is not None else "-",
            f"{1e3 * c.step_s:,.1f}" if c.step_s is not None else "-",
            f"{c.tokens_per_s:,.0f}" if c.tokens_per_s is not None else "-",
            f"{c.mfu:.1%}" if c.mfu is not None else "-", SOURCES[c.source], verdict]


def render_plan(result, gpus: int, global_batch: int, gpu: str, width: int | None = None) -> str:
    cands = result.candidates
    rows = [_row(i, c) for i, c in enumerate(cands)]
    head = (f"fxacct plan: {gpus} × {gpu}, global batch {global_batch}, {result.blocks} repeated blocks; "
            f"{result.traces + result.failed} traces{f' ({result.failed} raised)' if result.failed else ''}; "
            f"{counts(result)}")
    table = fit_table(HEADERS, rows, width, text_columns=(10, 1), optional=(9, 8, 6),
                      colalign=("left", "left") + ("right",) * 8 + ("left",))
    return "\n".join([wrap_lines(head, width), table, wrap_lines(LEGEND, width)]) + "\n"


def counts(result) -> str:
    """How the layouts were judged: with a trace of their own, from traces already run, pruned
    before any trace, and the rest settled by the search from their group's (no probe)."""
    settled = result.layouts - result.traced - result.reused - result.pruned
    return (f"{result.layouts} layouts: {result.traced} traced, {result.reused} reused, {result.pruned} pruned, "
            f"{settled} settled by their group")


def progress_line(probe) -> str:
    """One probed layout, as the plan goes (stderr)."""
    c = probe.candidate
    lay = c.layout
    verdict = "fits" if c.fits else (c.dominated or c.rejected)
    return (f"plan: {lay.mesh} mb {lay.micro_batch} ×{lay.accumulation} ckpt {_ckpt(lay.checkpoint)}: "
            f"{probe.how} in {probe.seconds:.1f} s, {SOURCES[c.source]}: {verdict}")


def plan_json(result) -> dict:
    return {"schema": PLAN_SCHEMA, "blocks": result.blocks, "traces": result.traces, "traces_failed": result.failed,
            "layouts_total": result.layouts, "layouts_traced": result.traced, "layouts_reused": result.reused,
            "layouts_pruned": result.pruned, "layouts": [
        {"mesh": c.mesh, "pp": c.layout.pp, "fsdp": c.layout.fsdp, "tp": c.layout.tp,
         # a mesh rejected before any micro-batch was chosen (one row for all): null, not 0
         "micro_batch": c.micro_batch or None, "micro_batches_per_step": c.layout.accumulation or None,
         "checkpoint": None if not c.micro_batch else "job" if c.layout.checkpoint is None else c.layout.checkpoint,
         "peak_bytes": c.peak_bytes,
         "fit_bytes": c.fit_bytes, "step_ms": None if c.step_s is None else 1e3 * c.step_s,
         "model_flops": c.model_flops, "tokens_per_s": c.tokens_per_s, "mfu": c.mfu, "source": c.source,
         "rank": i + 1 if c.fits else None, "fits": c.rejected is None, "dominated": c.dominated,
         "rejected": c.rejected} for i, c in enumerate(result.candidates)]}
