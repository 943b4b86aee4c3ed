"""Peak memory of one step: a walk over the captured ops, by storage.

Model (DESIGN.md, `peak_train_bytes`): a steady-state training step. Resident throughout:
parameters, buffers, the inputs and the optimizer state (allocated by an earlier step; gradients
were set to None). Every other storage is allocated by the op that first produced it and freed
when the traced program dropped its last reference to it, which fxacct.trace.capture observed on the
fake run: local variables going out of scope, autograd releasing what it saved, a view keeping
its base alive. The loop is `loss = training_loss(model(x)); loss.backward(); optimizer.step()`: the
outputs die once the loss is built, the loss and the gradients live to the end.
This is what a dispatch-level storage tracker sees in a real eager run (fxacct.runtime.storage_tracker),
not the allocator: kernel scratch (oneDNN workspaces, weight reorders) is not an aten tensor.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from fxacct.memory.fixed import CUBLAS_OPS
from fxacct.trace.capture import BACKWARD, FORWARD, Capture, tensor_metas
from fxacct.trace.graph_builder import CONSTANT, INPUT, PARAMETER, trace_of

PARAMETERS, BUFFERS, INPUTS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES = (
    "parameters", "buffers", "inputs", "gradients", "optimizer_state", "activations", "temporaries")
MASTER_WEIGHTS = "master_weights"
CATEGORIES = (PARAMETERS, MASTER_WEIGHTS, BUFFERS, INPUTS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES)


@dataclass(frozen=True)
class Peak:
    bytes: int
    node: str  # the op node at which the peak is reached ("" when the resident set is the peak)
    phase: str
    by_category: tuple[tuple[str, int], ...]  # composition at the peak; sums to `bytes`

    def category(self, name: str) -> int:
        return dict(self.by_category).get(name, 0)


@dataclass(frozen=True)
class Lifetimes:
    """Every storage of the step: resident ones, and (birth, death) op indices of the others."""

    resident: tuple[tuple[str, int], ...]  # (category, bytes)
    born: tuple[tuple[int, int, str, int], ...]  # (birth op, last op, category, bytes)
    op_names: tuple[str, ...]
    op_phases: tuple[str, ...]
    born_storages: tuple[int, ...] = ()  # the storage id of each ``born`` entry, in the same order
    resident_storages: tuple[int | None, ...] = ()  # likewise for ``resident`` (None: a repeat)
    # the op at which a run's first step makes each ``resident`` storage (the optimizer's state,
    # made lazily by its first step), None for those made before it; () where nothing says
    resident_births: tuple[int | None, ...] = ()
    # the first op that calls cuBLAS on the thread that runs the forward and on autograd's device
    # thread that runs the backward (each thread has its own cuBLAS handle and workspace:
    # fxacct.memory.fixed); None where that thread runs none
    first_cublas_ops: tuple[int | None, int | None] = (None, None)


def _is_lifted_constant(node: fx.Node, capture: Capture) -> bool:
    """A plain tensor made during the step (torch.tensor(0.) for an optimizer's step count) that
    the fake mode lifted: the lift_fresh output stands for it, so it is not counted twice."""
    if trace_of(node).role != CONSTANT:
        return False
    readers = ([u.target for u in node.users] if capture.ops is None
               else capture.ops.constant_users.get(node.name, ()))
    return bool(readers) and all(getattr(t, "__name__", "").startswith("lift_fresh") for t in readers)


def _ops(capture: Capture) -> tuple[tuple[str, ...], list, tuple[str, ...], list]:
    """(names, targets, phases, vals) of the capture's ops: its op nodes but getitems, or the
    OpList kept instead of them."""
    if capture.ops is not None:
        records = capture.ops.records
        return capture.ops.names, [r.op for r in records], tuple(r.phase for r in records), [r.outputs for r in records]
    nodes = [n for n in capture.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    return (tuple(n.name for n in nodes), [n.target for n in nodes], tuple(trace_of(n).phase for n in nodes),
            [n.meta.get("val") for n in nodes])


def lifetimes(capture: Capture) -> Lifetimes:
    """Resident storages, and for every other one the op that made it and the last op before the
    traced program dropped it (capture.deaths; absent: alive at the end of the step)."""
    graph = capture.graph
    resident: dict[int, tuple[str, int]] = {}
    repeated: list[tuple[int, tuple[str, int]]] = []  # (representative, entry): the parameters it stands for
    for state in capture.optimizer_state:
        resident[state.key] = (OPTIMIZER_STATE, state.nbytes)
        repeated += [(state.key, (OPTIMIZER_STATE, state.nbytes))] * (state.count - 1)
    for sid, nbytes, count in capture.master_weights:
        resident[sid] = (MASTER_WEIGHTS, nbytes)
        repeated += [(sid, (MASTER_WEIGHTS, nbytes))] * (count - 1)
    for node in graph.nodes:
        if node.op != "placeholder" or _is_lifted_constant(node, capture):
            continue
        role = trace_of(node).role
        category = PARAMETERS if role == PARAMETER else INPUTS if role == INPUT else BUFFERS
        for t in tensor_metas(node.meta.get("val")):
            resident.setdefault(t.storage, (category, t.storage_nbytes))

    names, targets, phases, vals = _ops(capture)
    end = len(names)
    deaths = capture.deaths or {}
    born: dict[int, tuple[int, int, str, int]] = {}
    made: dict[int, int] = {}  # resident storage -> the op that made it in the traced (first) step
    first_cublas: list[int | None] = [None, None]
    for i, (target, val) in enumerate(zip(targets, vals)):
        if target in CUBLAS_OPS:
            thread = int(phases[i] == BACKWARD)
            if first_cublas[thread] is None:
                first_cublas[thread] = i
        for t in tensor_metas(val):
            sid = t.storage
            if sid in resident:
                made.setdefault(sid, i)
                continue
            if sid in born:
                continue
            category = (GRADIENTS if sid in capture.grad_storages
                        else ACTIVATIONS if sid in capture.saved_storages else TEMPORARIES)
            born[sid] = (i, max(i, deaths.get(sid, end)), category, t.storage_nbytes)
    # a run makes the optimizer's state at its first step (torch.optim's _init_group), where the
    # traced step made it; parameters, buffers, inputs and master weights exist before it
    entries = list(resident.items()) + repeated
    births = tuple(made.get(sid) if category == OPTIMIZER_STATE else None for sid, (category, _) in entries)
    return Lifetimes(tuple(entry for _, entry in entries), tuple(born.values()), names, phases, tuple(born),
                     tuple(resident) + (None,) * len(repeated), births, tuple(first_cublas))


def _per_rank(nbytes: int, shards: int) -> int:
    return -(-nbytes // shards)  # ceil: a rank holds at most this much of a partitioned tensor


def walk(life: Lifetimes, shards: dict[str, int] | None = None, extra: dict[str, int] | None = None,
         timeline: list | None = None) -> Peak:
    """The peak of live bytes over the step. ``shards``: category -> ways each of its storages is
    partitioned across ranks (ZeRO); ``extra``: bytes resident throughout by category (a gathered
    ZeRO-3 layer). With a ``timeline`` list, append (op name, phase, {category: bytes}) per op."""
    shards = shards or {}
    live = {c: 0 for c in CATEGORIES}
    for category, nbytes in life.resident:
        live[category] += _per_rank(nbytes, shards.get(category, 1))
    for category, nbytes in (extra or {}).items():
        live[category] += nbytes
    births: dict[int, list] = {}
    deaths: dict[int, list] = {}
    for birth, death, category, nbytes in life.born:
        size = _per_rank(nbytes, shards.get(category, 1))
        births.setdefault(birth, []).append((category, size))
        deaths.setdefault(death, []).append((category, size))
    best = total = sum(live.values())  # ``total`` kept equal to sum(live.values())
    best_at, best_phase, best_live = "", FORWARD, dict(live)
    for i, name in enumerate(life.op_names):
        for category, size in births.get(i, ()):
            live[category] += size
            total += size
        if timeline is not None:
            timeline.append((name, life.op_phases[i], dict(live)))
        if total > best:
            best, best_at, best_phase, best_live = total, name, life.op_phases[i], dict(live)
        for category, size in deaths.get(i, ()):
            live[category] -= size
            total -= size
    return Peak(best, best_at, best_phase, tuple((c, best_live[c]) for c in CATEGORIES))
