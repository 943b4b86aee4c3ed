"""What autograd saves for the backward, seen through ``saved_tensors_hooks`` (a capture installs
SavedTracker's pack and unpack around the traced step)."""

from __future__ import annotations

import torch

from fxacct.errors import acts_for_torch
from fxacct.trace import torch_private as tp
from fxacct.trace.dispatch_recorder import Recorder
from fxacct.trace.records import Storages


class SavedTracker:
    """Pack hook of ``saved_tensors_hooks``: which storages autograd saves (ids, each once).
    It keeps the tensor itself, so what autograd keeps alive is what it would keep anyway, and
    its version: with a hook installed autograd skips its own check that a saved tensor was not
    modified in place, so unpack makes it, with autograd's message."""

    def __init__(self, storages: Storages, excluded: set[int], recorder: Recorder):
        self.storages = storages
        self.recorder = recorder
        self.excluded = excluded
        self.saved: dict[int, tuple[int, torch.dtype]] = {}  # id -> (bytes, dtype)
        # storage ids of the local shards of DTensors autograd saved (fxacct.trace.replay_train:
        # a block input saved only through a DTensor makes that block's training step unreplayable)
        self.wrapped: set[int] = set()

    @tp.torch_function_off  # fxacct's own reads (tp.no_torch_function)
    def pack(self, t: torch.Tensor):
        local = tp.local(t)  # a DTensor's bytes are its local shard's (its wrapper holds none)
        sid = self.storages.id_of(local)
        if local is not t:
            self.wrapped.add(sid)
        if sid not in self.excluded and sid not in self.saved:
            dtype, nbytes = self.storages.real.get(sid, (local.dtype, local.untyped_storage().nbytes()))
            self.saved[sid] = (nbytes, dtype)
        # without a hook autograd unpacks a saved output as a new Variable (a dispatched detach)
        # and a saved input as the tensor saved (no op)
        return t, t._version, tp.has_newest_grad_fn(t)

    @acts_for_torch
    def unpack(self, packed):
        t, version, output = packed
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a {t.dtype} tensor of shape {tuple(t.shape)} is at version {t._version}; "
                f"expected version {version}")
        if not output:
            self.recorder.unpacked = t  # the detach autograd runs on it next is fxacct's own
        return t
