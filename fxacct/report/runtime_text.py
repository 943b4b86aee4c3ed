"""The human report of a prediction (the roofline's step time) and of a runtime run (predicted beside
measured: step time and phases, peak memory, achieved FLOP/s and MFU, input transfer, per module
and per node). Ratios are measured / predicted."""

from __future__ import annotations

from fxacct.predict.gpu_kernels import kernel_totals
from fxacct.predict.roofline import COMPUTE, MEMORY, PHASES, Prediction
from fxacct.report.durations import format_ms
from fxacct.report.tables import tabulate
from fxacct.report.width import fit_table
from fxacct.runtime.compare import achieved_flops_per_s, mfu
from fxacct.units import format_bytes, format_count

NOT_CALIBRATED = ("predicted step time: not calibrated for this CPU (run `fxacct calibrate --device cpu`, "
                  "or give --gpu NAME for a GPU's datasheet)")


def ms(seconds: float | None) -> str:
    return format_ms(None if seconds is None else 1e3 * seconds)


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def rate(flops_per_s: float | None) -> str:
    """'1.219 GFLOP/s'."""
    if flops_per_s is None:
        return "-"
    text = format_count(flops_per_s)
    return f"{text[:-1]} {text[-1]}FLOP/s" if text[-1:].isalpha() else f"{text} FLOP/s"


def _div(a, b):
    return a / b if a is not None and b else None


def predicted_section(prediction: Prediction | None) -> str:
    if prediction is None:
        return NOT_CALIBRATED
    d, ph = prediction.device, prediction.by_phase
    bound = {COMPUTE: [0, 0.0], MEMORY: [0, 0.0]}
    for op in prediction.ops:
        if op.bound in bound:
            bound[op.bound][0] += 1
            bound[op.bound][1] += op.seconds
    total = prediction.step_s or 1.0
    phases = " + ".join(f"{p} {ms(ph[p])}" for p in PHASES)
    roofline = {b: sum(op.seconds - op.overhead_s for op in prediction.ops if op.bound == b) for b in bound}
    return "\n".join([
        f"predicted step time on {d.name} (roofline, {d.source}): {ms(prediction.step_s)}",
        f"  = {phases}",
        f"  {bound[COMPUTE][0]} compute-bound ops ({100 * roofline[COMPUTE] / total:.1f}% of the time), "
        f"{bound[MEMORY][0]} memory-bound ({100 * roofline[MEMORY] / total:.1f}%)",
        overhead_line(prediction, total),
        *kernels_line(prediction, total),
    ])


def kernels_line(prediction: Prediction, total: float) -> list[str]:
    """On a --gpu: '  kernels: gemm 61.2% of the time at 70.1% of peak, memory 20.3% at 90.4% of
    bandwidth, ...' (fxacct/predict/gpu_kernels.py); nothing for a calibrated device."""
    if prediction.device.gpu is None:
        return []
    parts = []
    for r in kernel_totals(prediction.ops):
        of = "bandwidth" if r.kind == "memory" else "peak"
        share = "" if r.peak_fraction is None else f" at {100 * r.peak_fraction:.1f}% of {of}"
        parts.append(f"{r.kind} {100 * r.seconds / total:.1f}% of the time{share}")
    return [f"  kernels (achievable rates, fxacct/predict/gpu_kernels.py): {', '.join(parts) or 'none'}"]


def overhead_line(prediction: Prediction, total: float) -> str:
    """'  per-op overhead: 1,234 ops × 2.16 µs = 2.67 ms (40.1% of the time; dispatch, calibrated ...)'."""
    d = prediction.device
    if not d.op_overhead_s:
        return f"  per-op overhead: none counted ({d.overhead_source or 'not known for this device'})"
    each = prediction.overhead_s / prediction.overhead_ops if prediction.overhead_ops else d.op_overhead_s
    return (f"  per-op overhead: {prediction.overhead_ops:,} ops × {format_ms(1e3 * each)} = "
            f"{ms(prediction.overhead_s)} ({100 * prediction.overhead_s / total:.1f}% of the time; "
            f"{d.overhead_source})")


def _totals_table(result) -> str:
    m, c = result.measured, result.comparison
    rows = [["step", ms(c.predicted.get("step")), ms(m.step_s), ratio(c.ratio(m.step_s, "step"))]]
    if not m.inference:
        rows += [["forward + loss", ms(c.predicted.get("forward")), ms(m.forward_s),
                  ratio(c.ratio(m.forward_s, "forward"))],
                 ["backward", ms(c.predicted.get("backward")), ms(m.backward_s),
                  ratio(c.ratio(m.backward_s, "backward"))],
                 ["optimizer", ms(c.predicted.get("optimizer")), ms(m.optimizer_s),
                  ratio(c.ratio(m.optimizer_s, "optimizer"))]]
    rows += [["peak memory (allocator)", format_bytes(c.predicted_peak_bytes), format_bytes(m.peak_bytes),
              ratio(_div(m.peak_bytes, c.predicted_peak_bytes))],
             ["peak memory (op level)", format_bytes(c.predicted_peak_bytes), format_bytes(m.op_level_peak_bytes),
              ratio(_div(m.op_level_peak_bytes, c.predicted_peak_bytes))]]
    return tabulate(rows, headers=["", "predicted", "measured", "measured/predicted"],
                    colalign=("left", "right", "right", "right"), disable_numparse=True)


def _rows_table(rows, first: str, with_op: bool, width: int | None = None) -> str:
    body = []
    for r in rows:
        name = r.name if not first == "module" else (("  " * max(0, r.depth - 1) + r.name) if r.name else "(root)")
        line = [name] + ([r.op.removeprefix("aten.").removesuffix(".default")] if with_op else [])
        body.append(line + [format_count(r.flops), ms(r.predicted_s), ms(r.measured_s), ratio(r.ratio),
                            rate(r.achieved_flops_per_s)])
    headers = [first] + (["op"] if with_op else []) + ["FLOPs", "predicted", "measured", "measured/predicted",
                                                       "achieved"]
    names = (0, 1) if with_op else (0,)
    # too narrow: names shortened in the middle, then achieved and FLOPs left out (ratios stay)
    return fit_table(headers, body, width, text_columns=names, optional=(len(headers) - 1, len(names)),
                     colalign=("left",) * len(names) + ("right",) * 5)


NOISY = 1.5  # slowest / fastest timed step above which the spread is called out
SCRATCH = 1.25  # allocator / predicted peak above which the kernel scratch is called out


def _scratch_note(predicted: int | None, allocator: int | None, op_level: int | None) -> list[str]:
    """A line when the allocator peak is well above the prediction: how much of it the op-level
    measurement explains (the account's own level) and how much is kernel scratch."""
    if not predicted or not allocator or allocator <= SCRATCH * predicted:
        return []
    level = "" if op_level is None else (
        f"; the op-level peak is {op_level / predicted:.2f}x, so {format_bytes(max(allocator - op_level, 0))} "
        "of it is memory the kernels take outside aten tensors")
    return [f"NOTE: the allocator peak is {allocator / predicted:.2f}x the predicted peak{level} (kernel scratch: "
            "oneDNN convolution and matmul buffers, weight reorders); budget for it from this measurement"]


def runtime_headline(result) -> list[str]:
    """What a --runtime run measured of the whole step: the device, the step times, predicted beside
    measured totals, the peaks and the achieved FLOP/s and MFU: what --summary shows of the run."""
    m, c = result.measured, result.comparison
    p = result.prediction
    what = "inference steps (forward, eval, no_grad)" if m.inference else "training steps"
    lines = [
        f"runtime on {m.device} ({m.device_name}, {m.threads} threads): {m.steps} timed {what} after "
        f"{m.warmup} warm-up; step and phase times are medians of plain steps, module and node times those "
        "of the median of as many steps under torch.profiler (its overhead included)",
        f"predicted for: {p.device.name} ({p.device.source})" if p is not None else
        "predicted for: nothing (this device is not calibrated: run `fxacct calibrate --device "
        f"{m.device.split(':')[0]}`)",
    ]
    if m.interrupted:
        lines.append(f"INTERRUPTED: {m.steps} of {m.steps_requested} timed steps completed; figures are over those")
    if not m.steps:
        return lines + ["no timed step completed: nothing was measured"]
    steps = sorted(t.step_s for t in m.step_times)
    spread = f"step times: fastest {ms(steps[0])}, median {ms(m.step_s)}, slowest {ms(steps[-1])}"
    if steps[0] > 0 and steps[-1] / steps[0] > NOISY:
        spread += (f" (the slowest is {steps[-1] / steps[0]:.1f}x the fastest: other work on this machine, "
                   "or too few warm-up steps; the fastest is the least disturbed figure)")
    lines.append(spread)
    lines += ["", _totals_table(result), "",
              f"allocator peak: {m.peak_source}; op-level peak: fxacct.runtime.storage_tracker over one step, the level "
              "peak_train_bytes is defined at (kernel scratch such as oneDNN buffers and allocator rounding "
              "show only in the allocator peak)"]
    lines += _scratch_note(c.predicted_peak_bytes, m.peak_bytes, m.op_level_peak_bytes)
    achieved = achieved_flops_per_s(c, m)
    u = mfu(c, m)
    lines.append(f"achieved: {rate(achieved)} of model FLOPs (matmul + attention, {format_count(c.model_flops)} "
                 f"per step); MFU {'-' if u is None else f'{100 * u:.1f}%'} of {rate(c.peak_flops_per_s)} "
                 f"({c.peak_source})")
    if m.transfer is not None:
        t = m.transfer
        lines.append(f"input transfer, one batch ({format_bytes(t.bytes)}) to {m.device}: pageable "
                     f"{ms(t.pageable_s)}, pinned + non_blocking {ms(t.pinned_s)}; step {ms(m.step_s)} "
                     f"({100 * t.pageable_s / m.step_s:.1f}% / {100 * t.pinned_s / m.step_s:.1f}% of it)")
    return lines


def runtime_section(result, depth: int = 2, top: int = 10, width: int | None = None) -> str:
    """runtime_headline, then the measured modules (to ``depth``) and the ``top`` nodes by measured time."""
    m, c = result.measured, result.comparison
    lines = runtime_headline(result)
    if not m.steps:
        return "\n".join(lines)
    modules = [r for r in c.modules if r.depth <= depth]
    lines += ["", f"modules (depth {depth}, inclusive):", _rows_table(modules, "module", False, width)]
    nodes = sorted(c.nodes, key=lambda r: -(r.measured_s or 0.0))[:top]
    lines += ["", f"top {top} nodes by measured time (forward + its backward):", _rows_table(nodes, "node", True, width)]
    if m.join is not None:
        lines.append(f"joined {m.join.matched} of {m.join.expected} forward op nodes to profiler events; backward "
                     f"outside modules (loss, gradient accumulation): {ms(m.join.outside_backward_s)}")
    return "\n".join(lines)


__all__ = ["predicted_section", "runtime_headline", "runtime_section", "NOT_CALIBRATED"]
