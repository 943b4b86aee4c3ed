"""What a capture keeps of tensors: metadata and storage identities, never the tensors.

A traced tensor carries a tag (``TAG``) naming the record (or placeholder) that produced it; a
storage gets an id that stays unique for the whole capture, and the moment the traced program
drops its last reference to it is noted (``Storages.deaths``), which is when an eager run frees it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

TAG = "_fxacct_ref"  # attribute set on each traced tensor: which record (or placeholder) made it


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What fxacct keeps of a tensor: enough for costs and bytes, holding no memory."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    storage: int  # storage id, unique within one capture; views share their base's
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


class StateTensor(NamedTuple):
    """One storage of optimizer state after a step."""

    dtype: torch.dtype
    nbytes: int
    key: int  # storage id
    scalar: bool  # a 0-dim tensor (a step count), not a per-parameter buffer
    count: int = 1  # parameters of this shape the representative stands for


class Storages:
    """Storage ids that stay unique for the whole capture, and when each storage died."""

    def __init__(self):
        self.ids: dict[int, int] = {}  # live storage _cdata -> id
        self.nbytes: dict[int, int] = {}  # id -> bytes
        self.deaths: dict[int, int] = {}
        self.clock = -1  # index of the last recorded op
        self.open = True
        # id -> (dtype, bytes) where the real kernel's output differs from the fake kernel's
        self.real: dict[int, tuple[torch.dtype, int]] = {}
        self.pinned: set[int] = set()  # deaths set by fxacct.trace.replay_train, not by the callback

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
        cdata = st._cdata
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
            self.deaths[sid] = self.clock


class Ref(NamedTuple):
    """A tensor argument in a record: the record (or placeholder) that produced it."""

    source: object  # int record index, or a placeholder key
    index: int | None  # output position of a multi-output op
