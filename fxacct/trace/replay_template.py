"""A replay template's own space (fxacct.trace.replay_train): a probed block's records with the
block's inputs, parameters and incoming gradients as Slots, so that two probes compare and a
template maps onto any block of its run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch

from fxacct.trace.dispatch_recorder import BACKWARD
from fxacct.trace.records import (
    NO_NUMBERS,
    TAG,
    DerivedFromRecord,
    OpRecord,
    Ref,
    Slot,
    TensorMeta,
    UnderAutogradNode,
    iter_nested,
    map_nested,
)
from fxacct.trace.records import comparable as comparable_args
from fxacct.trace.replay import _relative

aten = torch.ops.aten


@dataclass
class Template:
    fqn: str
    records: list  # forward records then backward records, refs normalized to template space
    fwd_len: int
    in_meta: list  # (shape, stride, dtype, requires_grad) per input tensor leaf
    plain: list  # input leaves, tensors replaced by None
    spec: object
    out_spec: object
    out_leaves: list  # Slot("out", i) for tensor outputs, plain values otherwise
    out_refs: list  # template ref of each tensor output
    out_storages: list  # template storage id of each tensor output
    grads: list  # per target: template ref (Ref or Slot) of its gradient, or None
    targets: list  # the gradient targets, in order: Slot("in", j) / Slot("param", name)
    deaths: dict  # template storage id -> template record index (absent: alive at the end)
    born: set  # storage ids born inside the probe
    saved: dict  # template storage id -> (bytes, dtype) saved by autograd
    saved_inputs: list  # indices of input leaves autograd saved
    storage_bytes: dict  # template storage id -> bytes
    gout_last_use: dict  # incoming gradient j -> index of the last template record reading it
    lingering: dict  # storage alive at the probe's end that is no output or gradient -> last use
    param_meta: tuple = ()  # the parameters as the probe's forward read them (fxacct.trace.replay._param_meta)
    grad_layouts: list = ()  # per target: (mesh, placements, shape, stride) of a DTensor gradient, else None
    # saved input j -> index of the last record of the backward node that last reads it (where the
    # engine lets that node's saved tensors go; the probe held its own inputs to the end)
    input_release: dict = field(default_factory=dict)


def to_template_space(records: list[OpRecord], fqn: str, ext_refs: dict, ext_store: dict) -> list[OpRecord]:
    """A probe's records with refs and storages of the block's own inputs, parameters and
    incoming gradients as Slots, module names relative to the block, and each backward link as
    the index of the probe's forward record it derives from."""
    seq_owner: dict[int, int] = {}
    out = []
    for i, r in enumerate(records):
        if r.phase == BACKWARD:
            link = r.link
            owner = seq_owner.get(link.sequence_nr) if isinstance(link, UnderAutogradNode) else None
            change = {"link": DerivedFromRecord(owner) if owner is not None else None, "module": None}
        else:
            for n in r.link.numbers():
                seq_owner[n] = i
            change = {"link": NO_NUMBERS, "module": _relative(r.module, fqn)}
        out.append(replace(r, args=norm_refs(r.args, ext_refs), kwargs=norm_refs(r.kwargs, ext_refs),
                           outputs=norm_outputs(r.outputs, ext_store), **change))
    return out


def last_uses(records: list[OpRecord], kind: str) -> dict:
    """j -> index of the last record whose arguments read Slot(kind, j)."""
    last = {}
    for i, r in enumerate(records):
        for slot in iter_nested((r.args, r.kwargs), Slot):
            if slot.kind == kind:
                last[slot.key] = i
    return last


def released_at(records: list[OpRecord], fwd_len: int, saved_inputs: list) -> dict:
    """Saved input j -> the index of the last backward record of the autograd node whose op last
    reads input j's storage (the input or a view of it, as a Linear saves its reshaped input): the
    engine releases a node's saved tensors once its apply returns, and a node's ops run
    contiguously. A reader of no known node: its own index."""
    wanted = {Slot("in", j): j for j in saved_inputs}

    def inputs_read(ref):  # a Ref, or a Slot where the template reads the input itself
        if isinstance(ref, Slot):
            return (wanted[ref],) if ref in wanted else ()
        if not isinstance(ref.source, int):
            return (wanted[ref.source],) if ref.source in wanted else ()
        out = records[ref.source].outputs
        metas = out if isinstance(out, tuple) else (out,)
        if ref.index is not None:
            metas = metas[ref.index:ref.index + 1]
        return tuple(wanted[m.storage] for m in metas if isinstance(m, TensorMeta) and m.storage in wanted)

    last = {}
    for i in range(fwd_len, len(records)):
        r = records[i]
        for ref in iter_nested((r.args, r.kwargs), (Ref, Slot)):
            for j in inputs_read(ref):
                last[j] = i
    out = {}
    for j, i in last.items():
        link, end = records[i].link, i
        while link is not None and end + 1 < len(records) and records[end + 1].link == link \
                and not _accumulates(records, records[end + 1]):
            end += 1
        out[j] = end
    return out


def _accumulates(records: list[OpRecord], r: OpRecord) -> bool:
    """Whether ``r`` is the engine summing two gradients of one tensor (an add of the products of
    two nodes, or of one and the block's incoming gradient, a Slot): it runs after the node's apply
    returned, under that node's link, its saved tensors already let go."""
    if r.op is not aten.add.Tensor:
        return False
    sources = {records[a.source].link if isinstance(a.source, int) else a.source
               for a in iter_nested(r.args, Ref)}
    sources |= set(iter_nested(r.args, Slot))
    return len(sources) > 1


def lingering(records: list[OpRecord], born: set, deaths: dict, outputs: set, grads: set) -> dict:
    """Storages born in the probe and alive at its end that are neither its outputs nor its
    gradients, with the index of the last record that produced or read them."""
    keep = {s for s in born if s not in deaths and s not in outputs and s not in grads}
    produced = {}
    last = {}
    for i, r in enumerate(records):
        metas = r.outputs if isinstance(r.outputs, tuple) else (r.outputs,)
        mine = {m.storage for m in metas if isinstance(m, TensorMeta)} & keep
        produced[i] = mine
        for sid in mine:
            last[sid] = i
        for ref in iter_nested((r.args, r.kwargs), Ref):
            for sid in produced.get(ref.source, ()):
                last[sid] = i
    return {sid: last[sid] for sid in keep if sid in last}


def find_meta(template: Template, ref: Ref) -> TensorMeta:
    val = template.records[ref.source].outputs
    return val[ref.index] if ref.index is not None else val


_PROBE_SLOTS = {"probe-in": "in", "probe-gout": "gout", "probe-param": "param"}


def norm_refs(a, ext_refs):
    def one(ref: Ref):
        if isinstance(ref.source, Slot) and ref.source.kind in _PROBE_SLOTS:
            return Slot(_PROBE_SLOTS[ref.source.kind], ref.source.key)
        return ext_refs.get(ref, ref)

    return map_nested(a, one, Ref)


def norm_outputs(val, ext_store):
    if isinstance(val, tuple):
        return tuple(norm_outputs(v, ext_store) for v in val)
    if not isinstance(val, TensorMeta):
        return val
    where = ext_store.get(val.storage, val.storage)
    return TensorMeta(val.shape, val.stride, val.dtype, where, val.storage_nbytes, val.requires_grad)


def block_mapper(refs, bases):
    """Template refs to the replayed block's: its own inputs/parameters/incoming gradients (Slots),
    and its own records (``bases``: where its forward and its backward records start, and the
    template's forward length). Made once per block; ``mapped(a)`` maps one record's arguments."""
    fwd_base, bwd_base, fwd_len = bases

    def one(x):
        if isinstance(x, Slot):
            return refs[x]
        if not x.is_record:
            return x
        index = fwd_base + x.source if x.source < fwd_len else bwd_base + x.source - fwd_len
        return Ref(index, x.index)

    def mapped(a):
        return map_nested(a, one, (Ref, Slot)) if a else a  # an empty kwargs dict is shared, never written

    return mapped


def comparable(t: Template):
    """A template with its storage ids renumbered by first appearance, so two probes compare."""
    order: dict = {}

    def sid(s):
        if isinstance(s, Slot) or s not in t.born:
            return s
        return ("born", order.setdefault(s, len(order)), t.deaths.get(s, "alive"), s in t.saved)

    def val(v):
        if isinstance(v, tuple):
            return tuple(val(x) for x in v)
        if isinstance(v, TensorMeta):
            return (v.shape, v.stride, v.dtype, v.requires_grad, sid(v.storage))
        return v

    recs = [replace(r, outputs=val(r.outputs), args=comparable_args(r.args), kwargs=comparable_args(r.kwargs))
            for r in t.records]
    return (recs, t.fwd_len, t.in_meta, t.plain, t.out_leaves, [sid(s) for s in t.out_storages],
            t.grads, t.targets, t.saved_inputs)


@contextlib.contextmanager
def tagged(params: dict):
    """Each parameter tagged as the probe's Slot("probe-param", name) while a probe runs."""
    before = {n: getattr(p, TAG, None) for n, p in params.items()}
    for n, p in params.items():
        setattr(p, TAG, Ref(Slot("probe-param", n)))
    try:
        yield
    finally:
        for n, p in params.items():
            setattr(p, TAG, before[n])


@contextlib.contextmanager
def tags_kept(tensors: list):
    """A probe's in-place ops on the block's buffers (BatchNorm's running statistics and
    num_batches_tracked) tag them with the probe's own record indices: their tags go back after
    it, as the program the step records never ran the probe."""
    before = [(t, getattr(t, TAG, None)) for t in tensors]
    try:
        yield
    finally:
        for t, tag in before:
            setattr(t, TAG, tag)
