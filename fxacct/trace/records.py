"""What a capture keeps of tensors: metadata and storage identities, never the tensors.

A traced tensor carries a tag (``TAG``) naming the record (or placeholder) that produced it; a
storage gets an id that stays unique for the whole capture, and the moment the traced program
drops its last reference to it is noted (``Storages.deaths``), which is when an eager run frees it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from fxacct.trace import torch_private as tp
from fxacct.trace.frozen_init import fast_init
from fxacct.trace.torch_private import key_of_storage

TAG = "_fxacct_ref"  # attribute set on each traced tensor: which record (or placeholder) made it


@fast_init
@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What fxacct keeps of a tensor: enough for costs and bytes, holding no memory."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    storage: int | Slot  # storage id, unique within one capture (views share their base's);
    # a Slot only inside a replay template, for the block's own inputs and parameters
    storage_nbytes: int
    requires_grad: bool = False

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel() * itemsize(self.dtype)


def tensor_metas(val) -> tuple[TensorMeta, ...]:
    """The TensorMetas of a node's val: one for a tensor, the tensors of a multi-output op."""
    if isinstance(val, TensorMeta):
        return (val,)
    if isinstance(val, (tuple, list)):
        return tuple(v for v in val if isinstance(v, TensorMeta))
    return ()


ITEMSIZES: dict[torch.dtype, int] = {}


def itemsize(dtype: torch.dtype) -> int:
    size = ITEMSIZES.get(dtype)
    if size is None:
        size = ITEMSIZES[dtype] = torch.empty((), dtype=dtype, device="meta").element_size()
    return size


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One storage of optimizer state after a step."""

    dtype: torch.dtype
    nbytes: int
    key: int  # storage id
    scalar: bool  # a 0-dim tensor (a step count), not a per-parameter buffer
    count: int = 1  # parameters of this shape the representative stands for


class Storages:
    """Storage ids that stay unique for the whole capture, and when each storage died."""

    def __init__(self):
        self.ids: dict[int, int] = {}  # live storage key (torch_private.storage_key) -> id
        self.nbytes: dict[int, int] = {}  # id -> bytes
        self.deaths: dict[int, int] = {}
        self.clock = -1  # index of the last recorded op
        self.open = True
        # id -> (dtype, bytes) where the real kernel's output differs from the fake kernel's
        self.real: dict[int, tuple[torch.dtype, int]] = {}
        self.pinned: set[int] = set()  # deaths set by fxacct.parallel.fsdp_reduce_replay, not by the callback
        # id -> (death, clock): a replayed block's incoming gradient or saved input (fxacct.trace.replay_node),
        # which dies at ``death`` (where the traced block let it go) if it is freed with the clock still
        # at ``clock`` (the block's backward returned and nothing else held it), else when it is freed
        self.released: dict[int, tuple[int, int]] = {}

    @property
    def next_id(self) -> int:
        return len(self.nbytes)

    def synthetic(self, nbytes: int) -> int:
        """An id for a storage that a replayed block (fxacct.trace.replay) would have allocated."""
        sid = len(self.nbytes)
        self.nbytes[sid] = nbytes
        return sid

    def id_of(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        cdata = key_of_storage(st)
        sid = self.ids.get(cdata)
        if sid is None:
            sid = len(self.nbytes)
            self.ids[cdata] = sid
            self.nbytes[sid] = st.nbytes()
            weakref.finalize(st, self._died, cdata, sid)
        return sid

    def _died(self, cdata: int, sid: int) -> None:
        if self.ids.get(cdata) == sid:
            del self.ids[cdata]
        if self.open and sid not in self.pinned:
            death, clock = self.released.pop(sid, (self.clock, None))
            self.deaths[sid] = death if clock == self.clock else self.clock


@dataclass(frozen=True, slots=True)
class Slot:
    """A tensor that no recorded op produced, by role: a graph placeholder (``input`` i,
    ``param`` / ``buffer`` id, ``constant`` i), or, in a replay template's own space, the block's
    ``in`` j / ``param`` name / incoming gradient ``gout`` j (``probe-in`` / ``probe-gout`` while
    the probe runs). Used both as a Ref source and, in a template, as a TensorMeta storage."""

    kind: str
    key: object


@fast_init
@dataclass(frozen=True, slots=True)
class Ref:
    """A tensor argument in a record: the record (index) or Slot that produced it."""

    source: int | Slot
    index: int | None = None  # output position of a multi-output op

    @property
    def is_record(self) -> bool:
        return isinstance(self.source, int)


# -- the backward link: how a record relates to autograd ---------------------------------------

@fast_init
@dataclass(frozen=True, slots=True)
class TookSequenceNumbers:
    """A forward (or loss, optimizer) op: the autograd sequence numbers it took, [first, end).
    A forward op that records a grad_fn takes the next number before it reaches the dispatch
    mode; the backward ops of that grad_fn run under the same number."""

    first: int
    end: int

    def numbers(self) -> range:
        return range(self.first, self.end)


@fast_init
@dataclass(frozen=True, slots=True)
class UnderAutogradNode:
    """A backward op the engine ran under the autograd Node with this sequence number."""

    sequence_nr: int


@fast_init
@dataclass(frozen=True, slots=True)
class DerivedFromRecord:
    """A backward op of a replayed block: derived from the forward record with this index."""

    index: int


NO_NUMBERS = TookSequenceNumbers(0, 0)
Link = TookSequenceNumbers | UnderAutogradNode | DerivedFromRecord | None  # None: no autograd Node


@fast_init
@dataclass(frozen=True, slots=True)
class OpRecord:
    """One aten op as the dispatch recorder saw it, holding no tensor."""

    op: object  # the OpOverload
    args: tuple  # tensors replaced by Refs
    kwargs: dict
    outputs: object  # TensorMeta, a tuple of TensorMeta/None for multi-output ops, or None
    phase: str
    module: str | None  # FQN it ran in; None for backward ops (their forward op's decides)
    link: Link
    args_requires_grad: tuple[bool, ...]
    scope: str | None  # "attention" inside SDPA's math path, "recompute" for re-run forward ops
    # a replayed record: the template record it repeats (same op, shapes, scope and links relative
    # to its block: the same costs); a replayed block's, an OpRecord; a replayed FSDP2 gather's or
    # copy-out's, its template's entry (fxacct.parallel.fsdp_replay); None for a traced op
    origin: object | None = field(default=None, compare=False)


_PLAIN = frozenset({int, float, bool, str, type(None)})  # leaves that are never mapped


def map_nested(a, fn, kind):
    """``a`` with every leaf of type ``kind`` inside nested lists, tuples and dicts replaced by
    ``fn(leaf)``: the one walker over op arguments (cheaper than a pytree walk on the hot path)."""
    if isinstance(a, kind):
        return fn(a)
    t = type(a)
    if t is tuple or t is list:  # a leaf of ``kind`` mapped here, not in a call of its own (the hot path)
        return t([x if type(x) in _PLAIN else fn(x) if isinstance(x, kind) else map_nested(x, fn, kind) for x in a])
    if isinstance(a, (list, tuple)):  # a subclass: rebuilt through its own constructor
        return t(map_nested(x, fn, kind) for x in a)
    if isinstance(a, dict):
        return {k: map_nested(v, fn, kind) for k, v in a.items()}
    return a


def iter_nested(a, kind):
    """Every leaf of type ``kind`` inside nested lists, tuples and dicts, in order."""
    if isinstance(a, kind):
        yield a
    elif isinstance(a, (list, tuple)):
        for x in a:
            yield from iter_nested(x, kind)
    elif isinstance(a, dict):
        for x in a.values():
            yield from iter_nested(x, kind)


def comparable(a):
    """Op arguments made comparable with ``==``. A c10d op's ScriptObject arguments are boxed
    afresh for every call (and their ``__eq__`` raises): a ProcessGroup stands as its group's name
    and a ReduceOp as its reduction, so two calls on one group with one reduction compare equal (two
    blocks of a model, two FSDP2 gathers, two tensor-parallel all-reduces); any other ScriptObject
    stands as its identity."""
    return map_nested(a, _script_object_key, torch.ScriptObject)


def _script_object_key(o) -> tuple:
    from torch.distributed import ProcessGroup

    try:
        return ("group", ProcessGroup.unbox(o).group_name)
    except (RuntimeError, TypeError):  # not a boxed ProcessGroup
        pass
    op = tp.reduce_op_type(o)
    return ("object", id(o)) if op is None else ("reduce_op", op)
