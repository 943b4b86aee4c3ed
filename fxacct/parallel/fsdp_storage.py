"""FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes and gathers it again into
the same storage resized back (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
``free_storage`` / ``alloc_storage``). Those resizes happen outside the dispatcher, so no recorded
op shows them; this module notes each one against the recorder's op index while a capture runs,
and cuts the storage's lifetime into the intervals it really holds memory: the unsharded
parameters are alive from their all-gather to their resharding, not for the whole step."""

from __future__ import annotations

from dataclasses import replace

from fxacct.memory.peak import BUFFERS, TEMPORARIES
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


def with_resizes(life, events):
    """``life`` (fxacct.memory.peak.Lifetimes) with each resized storage's single interval replaced
    by the intervals it held memory. A storage FSDP2 made before this capture (a model captured
    again: its gathered parameters and all-gather buffers exist already) is no resident constant
    either: it holds memory from each allocation to the next free, from the first op if the capture
    began with it allocated."""
    if not events:
        return life
    per_storage: dict[int, list[tuple[int, bool]]] = {}
    for sid, index, allocated in events:
        per_storage.setdefault(sid, []).append((index, allocated))
    born = dict(zip(life.born_storages, life.born))
    births = life.resident_births or (None,) * len(life.resident)
    resident = list(zip(life.resident_storages, life.resident, births))
    kept = []
    for sid, (birth, death, category, nbytes) in born.items():
        evs = per_storage.get(sid)
        if evs is None:
            kept.append((sid, (birth, death, category, nbytes)))
        else:
            kept += [(sid, iv) for iv in _intervals(evs, birth, death, category, nbytes)]
    still = []
    for sid, (category, nbytes), made in resident:
        evs = per_storage.get(sid)
        if evs is None or category != BUFFERS:
            still.append((sid, (category, nbytes), made))
        else:  # allocated at the first op unless the first event allocates it
            start = None if evs[0][1] else 0
            kept += [(sid, iv) for iv in _intervals(evs, start, len(life.op_names) - 1, TEMPORARIES, nbytes)]
    return replace(life, born=tuple(iv for _, iv in kept), born_storages=tuple(sid for sid, _ in kept),
                   resident=tuple(r for _, r, _ in still), resident_storages=tuple(sid for sid, _, _ in still),
                   resident_births=tuple(made for _, _, made in still))


def _intervals(evs, start, end, category, nbytes):
    """(birth, death, category, bytes) for each stretch a storage held memory: ``start`` its first
    birth (None: born at its first allocation event), ``end`` its last op alive."""
    out = []
    for index, allocated in evs:
        if allocated and start is None:
            start = max(index, 0)
        elif not allocated and start is not None:
            out.append((start, max(start, index), category, nbytes))
            start = None
    if start is not None:
        out.append((start, max(start, end), category, nbytes))
    return out


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
