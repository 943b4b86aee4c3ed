"""When two pipeline stages are the same step: the planner traces one stage of each shape twice
and, where both accounts agree, lets the later stages of that shape take the second's.

A stage's shape (StageShape) is what its trace depends on that can be read before tracing: every
submodule's class, its plain attributes (ints, floats, strings, ...), its own parameters' and
buffers' shapes, dtypes and requires_grad, and the names by which the module sits in the stage,
with the keys of a list-like container (``layers.20``) replaced by their position in it, so the
middle stages of a model cut evenly (blocks 20-39 and 40-59 of 80) share a shape; and the inputs
it receives (shapes, dtypes, requires_grad). What the shape cannot see (a ``parallelize`` that
treats ``layers.40`` differently from ``layers.20`` by its key, a checkpoint pattern that
matches some keys only) the two traced stages are compared for (same_figures), as block replay
probes two blocks: a difference there keeps every stage of that shape traced.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch

PLAIN = (int, float, str, bool, type(None))


def _plain(value) -> bool:
    return isinstance(value, PLAIN) or (isinstance(value, tuple) and all(isinstance(v, PLAIN) for v in value))


def _tensor(t) -> tuple:
    return (tuple(t.shape), str(t.dtype), bool(t.requires_grad)) if isinstance(t, torch.Tensor) else (repr(t),)


def stage_shape(part: torch.nn.Module, args, kwargs, checkpoint=()) -> tuple:
    """The StageShape of one stage module and its inputs (the module docstring); ``checkpoint``:
    the step's checkpoint patterns, whose matches by full name are part of it."""
    mods = []
    for name, m in part.named_modules():
        local = ".".join("#" if key.isdigit() else key for key in name.split(".")) if name else ""
        attrs = tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and _plain(v)))
        own = tuple((k, _tensor(t)) for k, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)))
        ckpt = any(fnmatchcase(name, p) for p in checkpoint)
        mods.append((local, type(m).__qualname__, attrs, own, ckpt))
    inputs = tuple(_tensor(a) for a in args) + tuple((k, _tensor(v)) for k, v in sorted(kwargs.items()))
    return tuple(mods), inputs


def same_figures(a, b) -> bool:
    """Two stage Profiles agree on every figure the plan reads and the pipeline replays: the op
    sequence of the trace (targets, output shapes, phases), the totals, the memory account and
    peaks, the collectives by op and phase, and the predicted times."""
    def ops(prof):  # a placeholder's target is its parameter's name (layers_20_...): its meta says the rest
        return [(n.op, "" if n.op == "placeholder" else str(n.target), str(n.meta.get("val", "")),
                 getattr(n.meta.get("trace"), "phase", None)) for n in prof.capture.graph.nodes]

    def collectives(prof):
        par = prof.parallel
        return None if par is None else [(r.op, r.mesh_dim, r.phase, r.count) for r in par.rows]

    return (a.accounting.totals == b.accounting.totals and a.memory.peak_train == b.memory.peak_train
            and a.memory.by_dtype == b.memory.by_dtype and collectives(a) == collectives(b)
            and (a.parallel.time if a.parallel else None) == (b.parallel.time if b.parallel else None)
            and ops(a) == ops(b))


__all__ = ["stage_shape", "same_figures"]
