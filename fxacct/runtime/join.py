"""Join torch.profiler events to fxacct's modules and nodes.

The run marks its structure with ``record_function`` ranges: ``fxacct.step`` around each timed step
and ``fxacct.module:<FQN>`` around every module call (global forward pre/post hooks, the FQN from
``named_modules()``, as fxacct.trace.capture names modules). Then:

- Module forward time: the summed duration of the module's ranges in a step (inclusive of its
  submodules, like fxacct's module FLOPs).
- Module backward time: every autograd function the backward runs is profiled as
  ``autograd::engine::evaluate_function: XBackward0`` carrying the *sequence number* of the forward
  op that created it; the forward op's event carries the same number. So a backward function
  belongs to the module whose range holds the forward op with its number (and to that module's
  ancestors). Backward work with no forward op inside a module (the loss's backward,
  AccumulateGrad of the parameters) is reported apart, as outside modules.
- Node times: within each module range, fxacct's forward nodes of that module are matched to the
  profiler's aten events by name and occurrence: the k-th ``aten::mm`` event of the module in a
  step is the module's k-th ``aten.mm`` node. The walk goes down from the range and stops at the
  first event whose name is still expected (a composite such as ``aten::linear``, which fxacct
  sees decomposed into ``t`` + ``addmm``, is descended into); nested module ranges are left to
  their own module. A node's backward time is that of the backward functions carrying its
  matched event's sequence number. Nodes left unmatched have no measured time (None).
- A duration is the event's CPU time on CPU, and the time of the GPU kernels it (and its
  children) launched on CUDA (``device_time_total``), so idle gaps are never attributed.

Every figure is that of one timed step, the median one (its step time is the median of the
steps'), so figures add up: a module's children to at most the module, the root to at most the step.
Medians per module would not (the median of a sum is not the sum of medians).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from fxacct.account.rollup import ancestors, inclusive

MODULE_PREFIX = "fxacct.module:"
STEP = "fxacct.step"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class Join:
    step: int  # the timed step the figures are of
    modules: dict  # FQN -> (forward s, backward s), inclusive
    nodes: dict  # forward node name -> (forward s or None, backward s or None)
    matched: int  # forward op nodes matched to a profiler event
    expected: int  # forward op nodes
    outside_backward_s: float  # backward work linked to no module (loss backward, AccumulateGrad)


def profiler_name(op: str) -> str:
    """'aten.mm.default' -> 'aten::mm' (the name torch.profiler gives the op's event)."""
    ns, _, rest = op.partition(".")
    return f"{ns}::{rest.partition('.')[0]}"


def _module_of(event) -> str | None:
    e = event.cpu_parent
    while e is not None:
        if e.name.startswith(MODULE_PREFIX):
            return e.name[len(MODULE_PREFIX):]
        e = e.cpu_parent
    return None


class _Steps:
    """The timed steps' ``fxacct.step`` ranges, and which step an event starts in."""

    def __init__(self, events):
        self.ranges = sorted((e for e in events if e.name == STEP), key=lambda e: e.time_range.start)
        self.starts = [e.time_range.start for e in self.ranges]

    def __len__(self) -> int:
        return len(self.ranges)

    def of(self, e) -> int | None:
        i = bisect.bisect_right(self.starts, e.time_range.start) - 1
        return i if i >= 0 and e.time_range.start <= self.ranges[i].time_range.end else None


def _match_forward(ranges, expected: dict, dur) -> tuple[dict, dict, dict]:
    """One step's module ranges -> (module forward s, node forward s, sequence nr -> node name):
    the k-th event named like a module's node is its k-th node; composites are descended into,
    nested module ranges are left to their own module."""
    mod_fwd: dict[str, float] = {}
    node_fwd: dict[str, float] = {}
    seq_node: dict[int, str] = {}
    counters: dict[str, dict[str, int]] = {}
    for r in sorted(ranges, key=lambda e: e.time_range.start):
        module = r.name[len(MODULE_PREFIX):]
        mod_fwd[module] = mod_fwd.get(module, 0.0) + dur(r)
        want = expected.get(module)
        if not want:
            continue
        count = counters.setdefault(module, {})
        stack = list(reversed(sorted(r.cpu_children, key=lambda e: e.time_range.start)))
        while stack:
            e = stack.pop()
            if e.name.startswith(MODULE_PREFIX):
                continue
            names = want.get(e.name)
            k = count.get(e.name, 0)
            if names is not None and k < len(names):
                count[e.name] = k + 1
                node_fwd[names[k]] = node_fwd.get(names[k], 0.0) + dur(e)
                if e.sequence_nr is not None and e.sequence_nr >= 0:
                    seq_node[e.sequence_nr] = names[k]
                continue
            stack.extend(reversed(sorted(e.cpu_children, key=lambda c: c.time_range.start)))
    return mod_fwd, node_fwd, seq_node


def _fill_containers(mod_fwd: dict) -> dict:
    """A module's range holds its submodules' ranges; a container never called (a ModuleList) has
    none, and gets the time of its nearest called descendants."""
    out = dict(mod_fwd)
    for module, seconds in mod_fwd.items():
        for a in list(ancestors(module))[1:]:
            if a in mod_fwd:
                break
            out[a] = out.get(a, 0.0) + seconds
    return out


def join(events, node_rows, device_time: bool = False, step: int = 0) -> Join:
    """``events``: torch.profiler FunctionEvents (``prof.events()``); ``node_rows``: the account's
    forward NodeRows (fxacct.account.accounting), in graph order; ``step``: which timed step (0-based)."""
    def dur(e) -> float:
        return (e.device_time_total if device_time else e.cpu_time_total) / 1e6  # µs -> s

    steps = _Steps(events)
    rows = [r for r in node_rows if r.op != "input"]
    if not 0 <= step < len(steps):
        return Join(step, {}, {r.name: (None, None) for r in rows}, 0, len(rows), 0.0)
    expected: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        expected.setdefault(r.module, {}).setdefault(profiler_name(r.op), []).append(r.name)
    ranges, backward_events, seq_module = [], [], {}
    for e in events:
        if e.name.startswith(MODULE_PREFIX):
            if steps.of(e) == step:
                ranges.append(e)
        elif e.name.startswith(BACKWARD_PREFIX):
            if steps.of(e) == step:
                backward_events.append(e)
        elif e.sequence_nr is not None and e.sequence_nr >= 0:
            module = _module_of(e)
            if module is not None:
                seq_module.setdefault(e.sequence_nr, module)
    mod_fwd, node_fwd, seq_node = _match_forward(ranges, expected, dur)
    mod_bwd: dict[str, float] = {}
    node_bwd: dict[str, float] = {}
    outside = 0.0
    for e in backward_events:
        module = seq_module.get(e.sequence_nr)
        if module is None:
            outside += dur(e)
            continue
        mod_bwd[module] = mod_bwd.get(module, 0.0) + dur(e)
        node = seq_node.get(e.sequence_nr)
        if node is not None:
            node_bwd[node] = node_bwd.get(node, 0.0) + dur(e)
    mod_fwd = _fill_containers(mod_fwd)
    backward = {m: b for m, (b,) in inclusive((m, (b,)) for m, b in mod_bwd.items()).items()}
    modules = {m: (mod_fwd.get(m, 0.0), backward.get(m, 0.0)) for m in set(mod_fwd) | set(backward)}
    nodes = {r.name: (node_fwd.get(r.name), node_bwd.get(r.name, 0.0) if r.name in node_fwd else None)
             for r in rows}
    matched = sum(1 for r in rows if r.name in node_fwd)
    return Join(step, modules, nodes, matched, len(rows), outside)


__all__ = ["Join", "join", "profiler_name", "MODULE_PREFIX", "STEP"]
