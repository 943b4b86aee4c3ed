"""The table of ``fxacct plan``: layouts that fit, by predicted throughput, then the rejected."""

from __future__ import annotations

from fxacct.report.tables import tabulate
from fxacct.units import format_bytes


def render_plan(cands, gpus: int, global_batch: int, gpu: str) -> str:
    rows = []
    for i, c in enumerate(cands):
        rows.append([str(i + 1) if c.fits else "-", c.mesh, str(c.micro_batch) if c.micro_batch else "-",
                     format_bytes(c.peak_bytes) if c.peak_bytes is not None else "-",
                     f"{1e3 * c.step_s:.2f}" if c.step_s is not None else "-",
                     f"{c.tokens_per_s:,.0f}" if c.tokens_per_s is not None else "-",
                     f"{c.mfu:.1%}" if c.mfu is not None else "-", "fits" if c.fits else c.rejected])
    head = ["rank", "mesh", "micro-batch", "peak / GPU", "step ms", "tokens/s (job)", "MFU", "verdict"]
    return "\n".join([f"fxacct plan: {gpus} × {gpu}, global batch {global_batch}",
                      tabulate(rows, headers=head, colalign=("left",) * 8)]) + "\n"


def plan_json(cands) -> list[dict]:
    return [{"mesh": c.mesh, "micro_batch": c.micro_batch, "peak_bytes": c.peak_bytes, "step_ms":
             None if c.step_s is None else 1e3 * c.step_s, "tokens_per_s": c.tokens_per_s, "mfu": c.mfu,
             "fits": c.fits, "rejected": c.rejected} for c in cands]
