"""The activation-checkpointing what-if (--checkpoint): both accounts side by side, and its JSON
section."""

from __future__ import annotations

from dataclasses import asdict

from fxacct.report.tables import tabulate
from fxacct.units import format_bytes, format_count

ROWS = (("activations (saved)", "activation_bytes", format_bytes),
        ("training peak", "peak_train_bytes", format_bytes),
        ("recompute FLOPs", "recompute_flops", format_count),
        ("largest batch (--gpu)", "max_batch", lambda n: f"{n:,}"))


def signed_change(d: int, fmt) -> str:
    """The change in its row's own unit, signed: '-1.50 MiB', '+12.3M', '0 B'."""
    return f"+{fmt(d)}" if d > 0 else fmt(d)


def side_by_side(spec, before, after) -> list[list[str]]:
    """A what-if table's rows: (label, field, format) of ``spec`` read from both sides, with the
    signed change; a field neither side has is left out, one side's absence shown as '—'."""
    rows = []
    for label, field, fmt in spec:
        a, b = getattr(before, field), getattr(after, field)
        if a is None and b is None:
            continue
        rows.append([label, "—" if a is None else fmt(a), "—" if b is None else fmt(b),
                     "—" if a is None or b is None else signed_change(b - a, fmt)])
    return rows


def checkpoint_section(w) -> str:
    """``w``: a fxacct.trace.checkpointing.CheckpointWhatIf."""
    rows = side_by_side(ROWS, w.eager, w.checkpointed)
    policy = f", policy {w.policy}" if w.policy else ""
    title = (f"activation checkpointing what-if ({', '.join(w.patterns)}: {len(w.modules)} module"
             f"{'s' if len(w.modules) != 1 else ''} wrapped{policy}):")
    table = tabulate(rows, headers=["", "without", "with --checkpoint", "change"],
                     colalign=("left", "right", "right", "right"))
    return f"{title}\n{table}"


def checkpoint_json(w) -> dict | None:
    """The JSON ``checkpoint`` section: {patterns, modules, policy, with: {...}, without: {...}}."""
    if w is None:
        return None
    return {"patterns": list(w.patterns), "modules": list(w.modules), "policy": w.policy,
            "with": asdict(w.checkpointed), "without": asdict(w.eager)}
