"""FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes and gathers it again into
the same storage resized back (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
``free_storage`` / ``alloc_storage``). Those resizes happen outside the dispatcher, so no recorded
op shows them; this module notes each one against the recorder's op index while a capture runs,
and cuts the storage's lifetime into the intervals it really holds memory: the unsharded
parameters are alive from their all-gather to their resharding, not for the whole step."""

from __future__ import annotations

import operator
from dataclasses import replace

from fxacct.trace import torch_private as tp
from fxacct.trace.records import tensor_metas


class StorageResizes:
    def __init__(self):
        self.recorder = None
        self.events: list[tuple[int, int, bool]] = []  # (storage id, op index, allocated after)

    def attach(self, recorder) -> None:
        self.recorder = recorder

    def _note(self, tensor, allocated: bool) -> None:
        rec = self.recorder
        if rec is not None and rec.recording:
            # a free takes effect after the last recorded op; an allocation before the next one
            index = len(rec.records) - (0 if allocated else 1)
            self.events.append((rec.storages.id_of(tensor), index, allocated))

    def watching(self):
        return tp.fsdp_storage_resizes(self._note)


def with_resizes(life, graph, events):
    """``life`` (fxacct.memory.peak.Lifetimes) with each resized storage's single (birth, death)
    interval replaced by the intervals it held memory."""
    if not events:
        return life
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    first: dict[int, tuple[int, int]] = {}
    for i, n in enumerate(ops):
        for t in tensor_metas(n.meta.get("val")):
            first.setdefault(t.storage, (i, t.storage_nbytes))
    per_storage: dict[int, list[tuple[int, bool]]] = {}
    for sid, index, allocated in events:
        if sid in first:
            per_storage.setdefault(sid, []).append((index, allocated))
    born = list(life.born)
    for sid, evs in per_storage.items():
        birth, nbytes = first[sid]
        entry = next((e for e in born if e[0] == birth and e[3] == nbytes), None)
        if entry is None:
            continue
        born.remove(entry)
        start = birth
        for index, allocated in evs:
            if allocated and start is None:
                start = max(index, 0)
            elif not allocated and start is not None:
                born.append((start, max(start, index), entry[2], nbytes))
                start = None
        if start is not None:
            born.append((start, max(start, entry[1]), entry[2], nbytes))
    return replace(life, born=tuple(born))


def unsave_resized(cap, events):
    """FSDP2's unsharded parameters are not activations, though autograd saves them (a matmul saves
    its weight): FSDP2 frees them after the forward and gathers them again for the backward. Their
    storages leave the saved set, so activation bytes are what they are without FSDP2; their
    lifetimes (with_resizes) still put them in the peak while they are gathered."""
    resized = {sid for sid, _, _ in events} & cap.saved_storages
    if not resized:
        return cap
    for node in cap.graph.nodes:
        trace = node.meta.get("trace")
        metas = tensor_metas(node.meta.get("val"))
        if trace is not None and trace.saved and metas and all(m.storage in resized for m in metas):
            node.meta["trace"] = replace(trace, saved=())
    return replace(cap, saved_storages=cap.saved_storages - resized)
