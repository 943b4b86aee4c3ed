"""The report of `fxacct calibrate`: what was measured, how stable it was, what was rejected, and
where it was stored."""

from __future__ import annotations

from fxacct.report.durations import format_ms
from fxacct.report.tables import tabulate
from fxacct.units import format_bytes


def _spread(cal, what: str) -> str:
    s = cal.spread.get(what)
    return "-" if s is None else f"{100 * s:.1f}%"


def _rows(cal) -> list[list[str]]:
    rows = []
    for key, rate in cal.matmul_flops_per_s.items():
        skinny = ", ".join(f"{d} rows {r / 1e12:.3f}" for d, r in cal.matmul_by_min_dim.get(key, {}).items()
                           if d != str(cal.sizes.get(key)))
        rows.append([f"matmul {key}", f"{rate / 1e12:.3f} TFLOP/s",
                     f"{cal.sizes.get(key, '-')}² operands" + (f"; skinny: {skinny}" if skinny else ""),
                     _spread(cal, f"matmul {key}")])
    for what, curves in (("convolution", cal.convolution_by_channels),
                         ("convolution backward", getattr(cal, "convolution_backward_by_channels", {}))):
        for key, by_channels in curves.items():
            for channels, rate in by_channels.items():
                rows.append([f"{what} {key}", f"{rate / 1e12:.3f} TFLOP/s", f"3×3, {channels} channels",
                             _spread(cal, f"convolution {key}")])
    if cal.dispatch_s_per_op is not None:
        rows.append(["per-op overhead", format_ms(1e3 * cal.dispatch_s_per_op),
                     "a small model's training step, beyond the roofline", _spread(cal, "per-op overhead")])
    for phase, seconds in getattr(cal, "dispatch_s_by_phase", {}).items():
        rows.append([f"per-op overhead, {phase}", format_ms(1e3 * seconds), "the same step's phase (median)",
                     _spread(cal, "per-op overhead")])
    if getattr(cal, "view_s_per_op", None) is not None:
        rows.append(["per-op overhead, view", format_ms(1e3 * cal.view_s_per_op), "dispatch alone (a 2×2 add)", "-"])
    for op, seconds in getattr(cal, "op_latency_s", {}).items():
        rows.append([f"latency {op.removeprefix('aten.').removesuffix('.default')}", format_ms(1e3 * seconds),
                     "fixed cost per call, beyond the per-op overhead", "-"])
    if getattr(cal, "profiled_dispatch_s_per_op", None) is not None:
        rows.append(["per-op overhead, profiled", format_ms(1e3 * cal.profiled_dispatch_s_per_op),
                     "the same under torch.profiler (--runtime)", _spread(cal, "per-op overhead under torch.profiler")])
    for op, rate in getattr(cal, "kernel_bytes_per_s", {}).items():
        rows.append([f"kernel {op.removeprefix('aten.').removesuffix('.default')}", f"{rate / 1e9:.2f} GB/s",
                     "1 MiB float32 activations", _spread(cal, "training kernels")])
    for moved, bandwidth in cal.bandwidth_by_bytes.items():
        rows.append(["memory bandwidth", f"{bandwidth / 1e9:.2f} GB/s",
                     f"{format_bytes(int(moved))} footprint (copy, add, mul_)", _spread(cal, "memory bandwidth")])
    return rows


def render_calibration(cal, path) -> str:
    table = tabulate(_rows(cal), headers=["measured", "rate", "on", "spread"],
                     colalign=("left", "right", "left", "right"), disable_numparse=True)
    return "\n".join([
        f"fxacct calibrate: {cal.name} ({cal.kind}, {cal.threads} threads, torch {cal.torch_version})",
        table,
        f"measured in {cal.seconds:.1f} s: each the fastest round, rounds repeated until two agree within 5%; "
        "spread = (slowest - fastest) / fastest round; 1 multiply-add = 2 FLOPs; GB/s = 1e9 B/s",
        *[f"warning: {w}" for w in cal.warnings],
        f"stored {path}: predictions for this {'CPU' if cal.kind == 'cpu' else 'GPU'} use these figures "
        "(matmul by smallest dimension, convolution by channels, per-op overhead by phase, latencies, "
        "bandwidth by footprint)",
    ]) + "\n"
