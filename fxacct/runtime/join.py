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


def join(events, node_rows, device_time: bool = False, step: int = 0) -> Join:
    """``events``: torch.profiler FunctionEvents (``prof.events()``); ``node_rows``: the account's
    forward NodeRows (fxacct.account.accounting), in graph order; ``step``: which timed step (0-based)."""
    def dur(e) -> float:
        return (e.device_time_total if device_time else e.cpu_time_total) / 1e6  # µs -> s

    steps = sorted((e for e in events if e.name == STEP), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in steps]
    n_steps = len(steps)

    def step_of(e) -> int | None:
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        return i if i >= 0 and e.time_range.start <= steps[i].time_range.end else None

    expected: dict[str, dict[str, list[str]]] = {}
    rows = [r for r in node_rows if r.op != "input"]
    for r in rows:
        expected.setdefault(r.module, {}).setdefault(profiler_name(r.op), []).append(r.name)

    mod_fwd = [dict() for _ in range(n_steps)]
    mod_bwd = [dict() for _ in range(n_steps)]
    node_fwd = [dict() for _ in range(n_steps)]
    node_bwd = [dict() for _ in range(n_steps)]
    outside = [0.0] * n_steps
    seq_module: dict[int, str] = {}
    seq_node: dict[int, str] = {}
    ranges: list[list] = [[] for _ in range(n_steps)]
    backward_events = []
    for e in events:
        if e.name.startswith(MODULE_PREFIX):
            s = step_of(e)
            if s is not None:
                ranges[s].append(e)
        elif e.name.startswith(BACKWARD_PREFIX):
            backward_events.append(e)
        elif e.sequence_nr is not None and e.sequence_nr >= 0:
            module = _module_of(e)
            if module is not None:
                seq_module.setdefault(e.sequence_nr, module)

    for s in range(n_steps):
        counters: dict[str, dict[str, int]] = {}
        for r in sorted(ranges[s], key=lambda e: e.time_range.start):
            module = r.name[len(MODULE_PREFIX):]
            mod_fwd[s][module] = mod_fwd[s].get(module, 0.0) + dur(r)
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
                    node_fwd[s][names[k]] = node_fwd[s].get(names[k], 0.0) + dur(e)
                    if e.sequence_nr is not None and e.sequence_nr >= 0:
                        seq_node[e.sequence_nr] = names[k]
                    continue
                stack.extend(reversed(sorted(e.cpu_children, key=lambda c: c.time_range.start)))

    for e in backward_events:
        s = step_of(e)
        if s is None:
            continue
        module = seq_module.get(e.sequence_nr)
        if module is None:
            outside[s] += dur(e)
            continue
        mod_bwd[s][module] = mod_bwd[s].get(module, 0.0) + dur(e)
        node = seq_node.get(e.sequence_nr)
        if node is not None:
            node_bwd[s][node] = node_bwd[s].get(node, 0.0) + dur(e)

    # a module's range holds its submodules' ranges; a container never called (a ModuleList) has
    # none, and gets the time of its nearest called descendants
    for s in range(n_steps):
        ranged = dict(mod_fwd[s])
        for module, seconds in ranged.items():
            for a in list(ancestors(module))[1:]:
                if a in ranged:
                    break
                mod_fwd[s][a] = mod_fwd[s].get(a, 0.0) + seconds
    if not 0 <= step < n_steps:
        return Join(step, {}, {r.name: (None, None) for r in rows}, 0, len(rows), 0.0)
    backward = {m: b for m, (b,) in inclusive((m, (b,)) for m, b in mod_bwd[step].items()).items()}
    modules = {m: (mod_fwd[step].get(m, 0.0), backward.get(m, 0.0)) for m in set(mod_fwd[step]) | set(backward)}
    nodes = {}
    matched = 0
    for r in rows:
        f = node_fwd[step].get(r.name)
        if f is not None:
            matched += 1
        nodes[r.name] = (f, node_bwd[step].get(r.name, 0.0) if f is not None else None)
    return Join(step, modules, nodes, matched, len(rows), outside[step])


__all__ = ["Join", "join", "profiler_name", "MODULE_PREFIX", "STEP"]
