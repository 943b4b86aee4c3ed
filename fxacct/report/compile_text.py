"""The compile what-if (--compile, --compile-blocks): eager and compiled side by side, and its JSON
section."""

from __future__ import annotations

from dataclasses import asdict

from fxacct.report.checkpoint_text import side_by_side, signed_change
from fxacct.report.tables import tabulate
from fxacct.units import format_bytes

ROWS = (("activations (saved)", "activation_bytes", format_bytes),
        ("training peak", "peak_train_bytes", format_bytes),
        ("kernels, forward + backward", "kernels", lambda n: f"{n:,}"),
        ("bytes moved by them", "bytes_moved", format_bytes),
        ("predicted step time", "predicted_step_ms", lambda ms: f"{ms:.3g} ms"))
TOP_MODULES = 8  # modules shown whose saved bytes change most


def compile_section(w) -> str:
    """``w``: a fxacct.trace.compiled.CompileWhatIf."""
    rows = side_by_side(ROWS, w.eager, w.compiled)
    names = sorted(set(w.eager.modules) | set(w.compiled.modules),
                   key=lambda m: -abs(w.compiled.modules.get(m, 0) - w.eager.modules.get(m, 0)))
    for m in [m for m in names if w.compiled.modules.get(m, 0) != w.eager.modules.get(m, 0)][:TOP_MODULES]:
        a, b = w.eager.modules.get(m, 0), w.compiled.modules.get(m, 0)
        rows.append([f"  saved in {m or '(root)'}", format_bytes(a), format_bytes(b), signed_change(b - a, format_bytes)])
    what = "the whole model" if w.regions == ("",) else f"{len(w.regions)} module{'s' if len(w.regions) != 1 else ''}"
    title = f"torch.compile what-if ({what} compiled, mode {w.mode}; inductor's partitioner, fusion modelled):"
    table = tabulate(rows, headers=["", "eager", "compiled", "change"], colalign=("left", "right", "right", "right"))
    return f"{title}\n{table}"


def compile_json(w) -> dict | None:
    """The JSON ``compile`` section: {regions, mode, compiled: {...}, eager: {...}}."""
    if w is None:
        return None
    return {"regions": list(w.regions), "mode": w.mode, "compiled": asdict(w.compiled), "eager": asdict(w.eager)}
