"""`fxacct check` and fxacct.testing output: one short table of budgets (value, limit, how far
over, verdict) that reads in a CI log (plain text, no colours), and its JSON document."""

from __future__ import annotations

from fractions import Fraction

from fxacct.report.durations import format_ms
from fxacct.report.tables import tabulate
from fxacct.tools.budgets import Budget, CheckResult
from fxacct.units import format_bytes, format_count

CHECK_SCHEMA = "fxacct.check/1"


def plain_number(v):
    """A JSON number: exact integers stay integers, fractions become floats."""
    if isinstance(v, Fraction):
        return int(v) if v.denominator == 1 else float(v)
    return v


def format_value(v, unit: str) -> str:
    if unit == "bytes":
        v = int(v)  # binary units for reading, the exact count for comparing with the flag
        return f"{format_bytes(v)} ({v:,} B)" if abs(v) >= 1024 else f"{v:,} B"
    if unit == "s":
        return format_ms(1e3 * float(v))
    if unit in ("params", "FLOPs"):
        v = plain_number(v)  # exact below 1e9 (a CI log compares digits), SI above
        return format_count(v) if abs(v) >= 10**9 else f"{v:,}" if isinstance(v, int) else f"{v:,.6g}"
    return f"{plain_number(v):,}"


def _margin(b: Budget) -> str:
    """How far over the limit (a budget that fails), or the headroom left (one that holds)."""
    text = ("over " if b.over > 0 else "headroom ") + format_value(abs(b.over), b.unit)
    frac = b.over_fraction
    if frac is not None:  # two significant digits below 0.1%, where one decimal would read 0.0%
        pct = 100 * abs(frac)
        shown = f"{pct:,.1f}%" if pct >= 0.1 or pct == 0 else f"{pct:.2g}%" if pct >= 0.001 else "under 0.001%"
        text += f" ({shown} of the limit)"
    return text


def budget_table(budgets) -> str:
    rows = [[b.name, b.what, format_value(b.value, b.unit), format_value(b.limit, b.unit), _margin(b),
             "ok" if b.ok else "OVER"] for b in budgets]
    return tabulate(rows, headers=["budget", "figure", "value", "limit", "margin", "status"],
                    colalign=("left", "left", "right", "right", "right", "left"))


def render_check(result: CheckResult) -> str:
    lines = [f"fxacct check: {result.model or 'module'}"]
    notes = [f"gpu {result.gpu}"] if result.gpu else []
    if result.mfu is not None:
        notes.append(f"step time at MFU {result.mfu:g} of {result.peak_flops_per_s / 1e12:g} TFLOP/s "
                     f"({result.peak_dtype} matmul peak)")
    if notes:
        lines.append("  " + "; ".join(notes))
    lines += [budget_table(result.budgets), ""]
    if result.ok:
        lines.append(f"ok: all {len(result.budgets)} budget(s) hold")
    else:
        names = ", ".join(b.name for b in result.failed)
        lines.append(f"FAILED: {len(result.failed)} of {len(result.budgets)} budget(s) over ({names})")
    return "\n".join(lines) + "\n"


def check_document(result: CheckResult, profile_doc: dict | None = None) -> dict:
    """The machine-readable verdict; ``profile_doc``'s config and totals ride along."""
    doc = {
        "schema": CHECK_SCHEMA, "model": result.model, "ok": result.ok,
        "budgets": [{"name": b.name, "figure": b.what, "value": plain_number(b.value),
                     "limit": plain_number(b.limit), "unit": b.unit, "ok": b.ok, "over": plain_number(b.over),
                     "over_fraction": b.over_fraction, "limit_source": b.limit_source}
                    for b in result.budgets],
        "assumptions": {"gpu": result.gpu, "mfu": result.mfu, "peak_flops_per_s": result.peak_flops_per_s,
                        "peak_dtype": result.peak_dtype},
    }
    if profile_doc is not None:
        doc["config"], doc["totals"] = profile_doc.get("config"), profile_doc.get("totals")
    return doc
