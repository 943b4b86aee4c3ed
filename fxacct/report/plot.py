"""The memory timeline of one training step as a stacked-area PNG (matplotlib, optional extra).

Data (``memory_timeline``) and drawing (``plot_memory``) are separate: the data is the per-op
live bytes by category from fxacct.memory.peak's walk, for one rank under ``--shard``, so the
tallest stack is exactly the reported training peak.
"""

from __future__ import annotations

import os
from pathlib import Path

from fxacct.errors import UsageError
from fxacct.memory import sharding
from fxacct.memory.peak import CATEGORIES, PARAMETERS, lifetimes, walk
from fxacct.report.files import atomic_file
from fxacct.units import GiB, format_bytes

_PHASE_COLORS = {"forward": "#4c72b0", "loss": "#c44e52", "backward": "#dd8452", "optimizer": "#55a868"}


def memory_timeline(profile) -> list[tuple[str, str, dict]]:
    """(op name, phase, {category: live bytes}) after each op's allocations, one item per op;
    per rank when the profile is sharded (as fxacct.step.sharded_peak walks it)."""
    timeline: list = []
    life = lifetimes(profile.capture)
    if profile.memory.per_rank is None:
        walk(life, timeline=timeline)
        return timeline
    cfg = profile.config
    unit = profile.memory.gathered_unit
    extra = {PARAMETERS: unit[1]} if unit is not None else {}
    walk(life, sharding.partitioned(cfg.shard, cfg.world_size), extra, timeline=timeline)
    return timeline


def _phase_spans(phases: list[str]) -> list[tuple[str, int, int]]:
    """Runs of consecutive ops in one phase: (phase, first index, last index)."""
    spans: list[tuple[str, int, int]] = []
    for i, phase in enumerate(phases):
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], i)
        else:
            spans.append((phase, i, i))
    return spans


def _title(profile) -> str:
    cfg = profile.config
    target = cfg.target or "module"
    path, sep, name = target.rpartition(":")
    if sep and os.path.isabs(path):
        target = f"{Path(path).name}:{name}"
    # a model of which nothing trains has no backward and no training peak: its step is the forward
    step = "one training step" if profile.capture.has_backward else "its forward (nothing trains: no training step)"
    title = f"{target}, batch {cfg.batch}: memory over {step}"
    if profile.memory.per_rank is not None:
        title += f"\nper rank, --shard {cfg.shard} --world-size {cfg.world_size}"
    pipe = profile.parallel.pipeline if profile.parallel is not None else None
    if pipe is not None:  # the plot is stage 0's trace: one micro-batch, not the schedule's step
        title = (f"{target}, micro-batch {cfg.batch}: stage 0's memory over one micro-batch's step\n"
                 f"(the schedule of {pipe.microbatches} micro-batches peaks at {format_bytes(pipe.peak_bytes)} on "
                 "its largest rank)")
    return title


def require_matplotlib(path: str) -> None:
    """Fail before any tracing when --plot cannot be honoured: no matplotlib, or a suffix naming
    no format it writes (a path without one is a PNG)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'fxacct[plot]'") from None
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = FigureCanvasAgg.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UsageError(f"--plot {path}: matplotlib writes no '.{suffix}' files; name a .png (or "
                         f"{', '.join('.' + f for f in sorted(formats) if f != 'png')})")


def plot_memory(profile, path: str) -> None:
    """Write the stacked memory timeline of ``profile``'s training step to ``path`` (PNG unless
    the suffix names another format matplotlib writes), atomically."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'fxacct[plot]'") from None

    timeline = memory_timeline(profile)
    if not timeline:
        raise UsageError("nothing to plot: the captured step has no ops")
    names = [name for name, _, _ in timeline]
    phases = [phase for _, phase, _ in timeline]
    stacks = [[live[c] for _, _, live in timeline] for c in CATEGORIES]

    fig = Figure(figsize=(11, 5.5))
    FigureCanvasAgg(fig)  # Agg: render to a file, never to a display
    ax = fig.add_subplot()
    draw_timeline(ax, names, phases, stacks)
    ax.set_title(_title(profile), fontsize=11)
    legends = _legends(ax, stacks, phases, Patch)
    _save(fig, path, legends)


# Drawing order, back to front: phase shading and boundaries, the memory stack, the peak marker,
# so a boundary line never hides a spike and the peak is drawn over everything.
Z_PHASES, Z_STACK, Z_PEAK = 0.5, 2, 6


def draw_timeline(ax, names, phases, stacks) -> dict:
    """Draw the stacked bytes (one list per category, one item per op) on ``ax`` as steps one op wide,
    so a spike of a single op is a visible column; returns the artists by role (for tests)."""
    x = list(range(len(names)))
    totals = [sum(col) for col in zip(*stacks)]
    peak_i = max(x, key=totals.__getitem__)
    polys = ax.stackplot(x, *[[b / GiB for b in ys] for ys in stacks],
                         labels=[c.replace("_", " ") for c in CATEGORIES],
                         colors=[f"C{i}" for i in range(len(CATEGORIES))], alpha=0.85, linewidth=0, step="mid",
                         zorder=Z_STACK)
    boundaries = []
    for phase, first, last in _phase_spans(phases):
        color = _PHASE_COLORS.get(phase, "grey")
        ax.axvspan(first - 0.5, last + 0.5, color=color, alpha=0.1, linewidth=0, zorder=Z_PHASES)
        if first > 0:
            boundaries.append(ax.axvline(first - 0.5, color=color, linestyle="--", linewidth=0.8, zorder=Z_PHASES))
    peak_gib = totals[peak_i] / GiB
    # a line from 0 to the peak at its op: visible however narrow one op is at this figure's width
    stem = ax.vlines([peak_i], 0, peak_gib, color="black", linewidth=1.0, zorder=Z_PEAK)
    marker = ax.plot([peak_i], [peak_gib], marker="v", color="black", markersize=8, zorder=Z_PEAK)[0]
    ax.annotate(f"peak {peak_gib:.4g} GiB ({totals[peak_i]:,} B)\nat {names[peak_i]} ({phases[peak_i]})",
                (peak_i, peak_gib), xytext=(0, 14), textcoords="offset points",
                ha="right" if peak_i > len(x) / 2 else "left", fontsize=9, zorder=Z_PEAK)
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_ylim(0, peak_gib * 1.15 or 1.0)
    ax.set_xlabel("op index in the step")
    ax.set_ylabel("GiB (2^30 bytes)")
    return {"stack": polys, "boundaries": boundaries, "peak": [stem, marker], "peak_index": peak_i}


def _legends(ax, stacks, phases, patch) -> list:
    """The memory categories that occur (upper right) and the phases shaded (lower right)."""
    handles, labels = ax.get_legend_handles_labels()
    used = [(h, lab) for h, lab, ys in zip(handles, labels, stacks) if any(ys)]
    categories = ax.legend([h for h, _ in used], [lab for _, lab in used], loc="upper left",
                           fontsize=8, bbox_to_anchor=(1.0, 1.0), title="memory", title_fontsize=8)
    ax.add_artist(categories)
    shown = dict.fromkeys(phases)
    phase_legend = ax.legend([patch(color=_PHASE_COLORS.get(ph, "grey"), alpha=0.3) for ph in shown],
                             list(shown), loc="lower left", fontsize=8, bbox_to_anchor=(1.0, 0.0),
                             title="phase (shaded)", title_fontsize=8)
    return [categories, phase_legend]


def _save(fig, path: str, legends: list) -> None:
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    with atomic_file(path, binary=True) as f:
        fig.savefig(f, format=fmt, dpi=120, bbox_inches="tight", bbox_extra_artists=legends)
