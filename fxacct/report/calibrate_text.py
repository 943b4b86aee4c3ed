"""The report of `fxacct calibrate`: what was measured, and where it was stored."""

from __future__ import annotations

from fxacct.report.tables import tabulate

from fxacct.units import format_bytes


def render_calibration(cal, path) -> str:
    rows = [[f"matmul {key}", f"{rate / 1e12:.3f} TFLOP/s", f"{cal.sizes.get(key, '-')}² operands"]
            for key, rate in cal.matmul_flops_per_s.items()]
    for moved, bandwidth in cal.bandwidth_by_bytes.items():
        rows.append(["memory bandwidth", f"{bandwidth / 1e9:.2f} GB/s",
                     f"{format_bytes(int(moved))} footprint (copy, add, mul_)"])
    return "\n".join([
        f"fxacct calibrate: {cal.name} ({cal.kind}, {cal.threads} threads, torch {cal.torch_version})",
        tabulate(rows, headers=["measured", "rate", "on"], colalign=("left", "right", "left")),
        f"measured in {cal.seconds:.1f} s, best of repetitions; 1 multiply-add = 2 FLOPs; GB/s = 1e9 B/s",
        f"stored {path}: predictions for this {'CPU' if cal.kind == 'cpu' else 'GPU'} use it",
    ]) + "\n"
