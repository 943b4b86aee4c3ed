"""`fxacct estimate` output: short tables with units, and JSON documents, for the calculators of
fxacct.tools.estimate."""

from __future__ import annotations

from fractions import Fraction

from fxacct.report.check_text import plain_number
from fxacct.report.durations import format_seconds
from fxacct.report.tables import tabulate
from fxacct.tools.estimate import DAYS_PER_MONTH, FlopsEstimate, MaxParams, TrainTime
from fxacct.units import FLOPS_PER_FMA, GB, format_count

ESTIMATE_SCHEMA = "fxacct.estimate/1"
CATEGORY_LABELS = {"parameters": "parameters", "gradients": "gradients", "master_weights": "master weights",
                   "optimizer_state": "optimizer state"}


def sci(x) -> str:
    """6.3e24 -> '6.30e24' (three significant figures, as the seeds print)."""
    return f"{float(x):.2e}".replace("e+", "e")


def decimal(x: Fraction | int) -> str:
    x = Fraction(x)
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.4g}"


def _grouped(x) -> str:
    x = Fraction(x)
    return f"{x.numerator:,}" if x.denominator == 1 else f"{float(x):,.4g}"


def days_text(days: float) -> str:
    return f"{days:,.0f}" if days >= 100 else f"{days:.3g}"


def short_count(n: int) -> str:
    """40_000_000_000 -> '40B', 8_888_888_888 -> '8.9B', 125_000_000 -> '125M' (one decimal at most)."""
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + suffix
    return str(n)


def render_train_time(r: TrainTime) -> str:
    if r.flops_source == "profile":
        source = (f"{r.profile_model or 'profile'}: {_grouped(r.flops_per_token)} FLOPs per token "
                  "(forward + backward, matmul + attention) × D")
    else:
        source = f"6·N·D with N = {r.params:,} parameters"
    rows = [
        ["total FLOPs", sci(r.total_flops), f"{source}, D = {r.tokens:,} tokens"],
        ["GPU peak", f"{r.peak_flops_per_s / 1e12:g} TFLOP/s",
         f"{r.gpu}, {r.peak_dtype}, dense" + (f"; dtype from {r.peak_dtype_source}" if r.peak_dtype_source else "")],
        ["MFU", f"{r.mfu:g}", "achieved / peak FLOP/s"],
        ["GPUs", f"{r.world_size:,}", ""],
        ["FLOPs per day", sci(r.flops_per_day), "peak × MFU × GPUs × 86,400 s"],
        ["time to train", format_seconds(r.days * 86_400),
         f"{days_text(r.days)} days (the unit by magnitude; a month is {DAYS_PER_MONTH} days, a year 365)"],
    ]
    lines = ["fxacct estimate train-time",
             tabulate(rows, headers=["quantity", "value", "from"], colalign=("left", "right", "left")), "",
             f"{format_seconds(r.days * 86_400)} ({days_text(r.days)} days) on {r.world_size:,} × {r.gpu} "
             f"at MFU {r.mfu:g}"]
    if r.six_n_d_flops:
        lines.append(f"(6·N·D with the profile's N = {r.params:,} would give {sci(r.six_n_d_flops)} FLOPs)")
    lines.append("not included: communication, data loading, restarts, evaluation")
    return "\n".join(lines) + "\n"


def train_time_document(r: TrainTime) -> dict:
    return {"schema": ESTIMATE_SCHEMA, "estimate": "train-time", "flops_source": r.flops_source,
            "model": r.profile_model, "params": r.params, "tokens": r.tokens,
            "flops_per_token": plain_number(r.flops_per_token), "total_flops": plain_number(r.total_flops),
            "gpu": r.gpu, "peak_dtype": r.peak_dtype, "peak_dtype_source": r.peak_dtype_source, "peak_flops_per_s": r.peak_flops_per_s, "mfu": r.mfu,
            "world_size": r.world_size, "flops_per_s": r.flops_per_s, "flops_per_day": r.flops_per_day,
            "days": r.days, "months": r.months, "days_per_month": DAYS_PER_MONTH,
            "six_n_d_flops": r.six_n_d_flops}


def _part_detail(part) -> str:
    if part.state:
        return " + ".join(f"{name} {dt} {decimal(b)}" for name, dt, b in part.state)
    return part.dtype or "none"


def render_max_params(r: MaxParams) -> str:
    b = r.per_param
    sharding = "no sharding" if b.shard == "none" else f"{b.shard} over {b.world_size} ranks"
    rows = [[CATEGORY_LABELS.get(p.category, p.category), _part_detail(p), decimal(p.bytes_per_param),
             f"÷{p.ways}" if p.ways > 1 else "no", decimal(p.per_rank)] for p in b.parts]
    rows.append(["total", "", decimal(b.total), "", decimal(b.per_rank)])
    n = r.max_params
    lines = [f"fxacct estimate max-params: {b.optimizer}, {b.precision}, {sharding}",
             tabulate(rows, headers=["bytes per parameter", "dtype / state", "bytes", "sharded", "per rank"],
                      colalign=("left", "left", "right", "left", "right")), "",
             f"max parameters: {short_count(n)} ({n:,}) = {r.capacity_bytes:,} B per GPU "
             f"({r.capacity_bytes / GB:g} GB; {r.capacity_source}) ÷ {decimal(b.per_rank)} B per parameter per rank",
             "not included: activations (they grow with batch and sequence length), buffers, temporaries"
             + (", the unit gathered at a time" if b.shard in ("zero3", "fsdp") else "")
             + ", framework and allocator overhead"]
    return "\n".join(lines) + "\n"


def max_params_document(r: MaxParams) -> dict:
    b = r.per_param
    return {"schema": ESTIMATE_SCHEMA, "estimate": "max-params", "optimizer": b.optimizer,
            "precision": b.precision, "shard": b.shard, "world_size": b.world_size,
            "parts": [{"category": p.category, "dtype": p.dtype,
                       "state": [{"name": n, "dtype": dt, "bytes_per_param": plain_number(x)} for n, dt, x in p.state],
                       "bytes_per_param": plain_number(p.bytes_per_param), "ways": p.ways,
                       "bytes_per_param_per_rank": plain_number(p.per_rank)} for p in b.parts],
            "bytes_per_param": plain_number(b.total), "bytes_per_param_per_rank": plain_number(b.per_rank),
            "capacity_bytes": r.capacity_bytes, "capacity_source": r.capacity_source, "max_params": r.max_params,
            "activations_included": False}


def render_flops(r: FlopsEstimate) -> str:
    terms = ", ".join(f"{k} = {v:,}" for k, v in r.terms)
    approx = sci(r.flops) if r.flops >= 10**15 else format_count(r.flops)
    return f"{r.formula} with {terms}: {r.flops:,} FLOPs ({approx}; 1 multiply-add = {FLOPS_PER_FMA} FLOPs)\n"


def flops_document(r: FlopsEstimate) -> dict:
    return {"schema": ESTIMATE_SCHEMA, "estimate": "flops", "formula": r.formula, "terms": dict(r.terms),
            "flops": r.flops, "flops_per_fma": FLOPS_PER_FMA}
