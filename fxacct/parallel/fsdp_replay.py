"""FSDP2's gathers replayed: a block's all-gather and its copy into the unsharded parameters are
the same ops, block after block, so they are traced twice and then appended from a template.

Under ``--mesh`` FSDP2 gathers every block's parameters before its forward, again before its
backward, and once more in the inference forward: ``foreach_all_gather`` (an ``empty`` output
buffer, ``fsdp.all_gather_copy_in``, ``c10d._allgather_base_``) and
``foreach_all_gather_copy_out`` (a view per parameter and ``fsdp.split_with_sizes_copy`` into the
gathered parameters' storages, resized back first). Tracing those ops costs more than the block
replay (fxacct.trace.replay_train) saves on the block itself, for the 70B model about a tenth of
the profile. Only the ops are replayed: FSDP2's own Python runs around them as it is (its states,
prefetches, the all-gather buffer it keeps until the next block's copy-out, its resharding), and
each replay hands back what the function would have: a real (fake) output buffer, whose lifetime
FSDP2 then decides as before, and the gathered parameters' storages resized as FSDP2 resizes them.

What makes two calls the same (``_gather_key``, ``_copy_out_key``): the same process group and
collective, every parameter's shard shape, strides and dtype, its all-gather dtype, a plain shard
(no all-gather extension, no CPU offload, no post-forward reshard) and, for a copy-out, gathered
storages FSDP2 has made already. A block's first copy-out (the first forward's) makes them
(``FSDPParam.init_all_gather_outputs``: an ``empty`` each) and has a key of its own
(``_first_copy_out_key``): replayed, FSDP2's own method makes them unrecorded, the template's
``empty`` records stand for them, and FSDP2's resize calls on them are noted as the traced call
made them.
The first two calls of a key are traced and their ops compared in template space (arguments as
roles: a parameter's shard, the gathered buffer, a parameter's gathered storage; outputs by
storage, born in the call or a role's); from the third on, calls replay. A template that did
anything else (an op reading another tensor, a storage resize it does not explain) never
replays. ``--no-dedup`` traces every call, and tests/test_parallel_replay.py checks that both give
the same account, collectives and peaks. The backward's reduce-scatters (``foreach_reduce``)
replay through the same templates: fxacct.parallel.fsdp_reduce_replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from fxacct.parallel.fsdp_reduce_replay import replay_reduce
from fxacct.trace import torch_private as tp
from fxacct.trace.records import TAG, Ref, Slot, TensorMeta, comparable, map_nested

_UNSEEN = object()


@dataclass
class _Template:
    records: list  # (op, args, kwargs, outputs, args_requires_grad) in template space
    born_bytes: dict  # ("born", n) -> storage bytes
    deaths: dict  # ("born", n) -> record index (relative) where it died inside the call
    # what a gather hands back: (template ref of the gathered buffer, its born key, (AllGatherResult's
    # class, the buffer's shape and dtype, the result's other fields: its inputs' dtypes and sizes))
    result: tuple | None
    # a block's first copy-out: per parameter, (template ref, born key) of the gathered storage it
    # made (FSDPParam.init_all_gather_outputs), which outlives the call
    made: tuple = ()
    # and FSDP2's resize calls on them inside the call, as (position in ``made``, record index
    # relative to the call, allocated after): fxacct.parallel.fsdp_storage's events
    made_events: tuple = ()
    role_deaths: dict = dataclasses.field(default_factory=dict)  # role -> record index (relative) it died at

    def comparable(self):
        return ([(op, comparable(a), comparable(k), out, rg) for op, a, k, out, rg in self.records],
                self.born_bytes, self.deaths, self.result, self.made, self.made_events, self.role_deaths)


class GatherReplay:
    """For one capture: attached to its recorder, installed around the traced step."""

    def __init__(self, resizes):
        self.recorder = None
        self.resizes = resizes  # fxacct.parallel.fsdp_storage.StorageResizes of the same capture
        self.seen: dict = {}  # key -> _Template (one traced call), a proven _Template, or None (never)
        self.proven: set = set()
        self.replayed = 0

    def attach(self, recorder) -> None:
        self.recorder = recorder

    def installed(self):
        return tp.fsdp_gathers_patched(self._all_gather, self._copy_out, self._reduce)

    def _reduce(self, call):
        """FSDP2's foreach_reduce (fxacct.parallel.fsdp_reduce_replay)."""
        return replay_reduce(self, call)

    # -- the two functions ---------------------------------------------------------------------

    def _all_gather(self, call):
        """FSDP2's foreach_all_gather, as ``call`` (fxacct.trace.torch_private.TorchCall) made it."""
        fsdp_params, group, comm = call.get("fsdp_params"), call.get("group"), call.get("all_gather_comm")
        replayable = call.get("async_op") is False and call.at_defaults_except(tp.FSDP_GATHER_ARGS)
        key = _gather_key(fsdp_params, group, comm) if replayable else None
        roles = {Slot("shard", j): tp.fsdp_param_shard(p) for j, p in enumerate(fsdp_params)} if key else {}
        if key is not None and key in self.proven and self._recording():
            template = self.seen[key]
            ref, born, (cls, shape, dtype, fields) = template.result
            stream = call.get("all_gather_stream")
            stream.wait_stream(call.get("all_gather_copy_in_stream"))
            with self.recorder.suppressed():
                buffer = torch.empty(shape, dtype=dtype, device=call.get("device"))
            base = self._emit(template, roles, {born: buffer})
            self.recorder.tag(buffer, _mapped(ref, base))
            return cls(all_gather_output=buffer, all_gather_event=stream.record_event(), all_gather_work=None,
                       **fields)
        return self._traced(key, roles, call.run, returns_buffer=True)

    def _copy_out(self, call):
        """FSDP2's foreach_all_gather_copy_out, as ``call`` made it. A copy-out given anything else
        than what it takes by default (torch 2.15's ``all_gather_output_fn`` set to another
        function than FSDP2's own) runs as it is, traced, never replayed."""
        result, fsdp_params, group = call.get("all_gather_result"), call.get("fsdp_params"), call.get("group")
        plain = call.at_defaults_except(tp.FSDP_COPY_OUT_ARGS)
        first = _first_copy_out_key(result, fsdp_params, group) if plain else None
        if first is not None:
            return self._first_copy_out(first, result, fsdp_params, group, call.run)
        key = _copy_out_key(result, fsdp_params, group) if plain else None
        roles = {}
        if key is not None:
            roles = {Slot("gathered", j): p.all_gather_outputs[0] for j, p in enumerate(fsdp_params)}
            roles[Slot("buffer", 0)] = result.all_gather_output
        if key is not None and key in self.proven and self._recording():
            for p in fsdp_params:  # FSDP2 resizes each gathered storage back before copying into it
                p.alloc_all_gather_outputs()
            self._emit(self.seen[key], roles, {})
            return None
        return self._traced(key, roles, call.run, returns_buffer=False,
                            resized=[roles[Slot("gathered", j)] for j in range(len(fsdp_params))] if key else ())

    def _first_copy_out(self, key, result, fsdp_params, group, run):
        """A block's first copy-out (the first forward's) also makes the storages its parameters
        are gathered into: FSDPParam.init_all_gather_outputs, one ``empty`` each. Replayed, FSDP2's
        own method makes them, unrecorded, and the template's records are appended with its
        ``empty`` records standing for them; they live on as FSDP2 keeps them."""
        roles = {Slot("buffer", 0): result.all_gather_output}
        if key not in self.proven or not self._recording():
            return self._traced(key, roles, run, returns_buffer=False,
                                made=lambda out: [p.all_gather_outputs[0] for p in fsdp_params])
        template = self.seen[key]
        world, device = group.size(), result.all_gather_output.device
        with self.recorder.suppressed():
            for p, numels, dtypes in zip(fsdp_params, result.param_all_gather_input_numels,
                                         result.param_all_gather_input_dtypes):
                p.init_all_gather_outputs(numels, dtypes, world, device)
                p.alloc_all_gather_outputs()
        gathered = [p.all_gather_outputs[0] for p in fsdp_params]
        base = self._emit(template, roles, {born: t for (_, born), t in zip(template.made, gathered)})
        for (ref, _), t in zip(template.made, gathered):
            self.recorder.tag(t, _mapped(ref, base))
        storages = self.recorder.storages
        self.resizes.events += [(storages.id_of(gathered[j]), base + index, allocated)
                                for j, index, allocated in template.made_events]
        return None

    # -- tracing a call and learning its template ----------------------------------------------

    def _recording(self) -> bool:
        return self.recorder is not None and self.recorder.recording

    def role_keys(self, roles: dict) -> tuple[dict, dict]:
        """(ref -> role, storage id -> role) of a call's roles (role -> tensor), holding none of
        the tensors: taken before a call whose roles die in it, they let them die."""
        return ({getattr(t, TAG): slot for slot, t in roles.items() if getattr(t, TAG, None) is not None},
                {self.recorder.storages.id_of(t): slot for slot, t in roles.items()})

    def _traced(self, key, roles, run, returns_buffer: bool, resized=(), made=None):
        """``roles``: role -> tensor, read once the call has run (a role first read in the call is
        tagged there), or their role_keys taken before it (a reduce-scatter's roles die in it).
        ``made(out)``: after the call, the tensors it made that outlive it (a first copy-out's, a
        reduce-scatter's), or None where what it returned is not what a replay would."""
        if key is None or not self._recording() or self.seen.get(key, _UNSEEN) is None:
            return run()
        rec, storages = self.recorder, self.recorder.storages
        start, first_sid, events = len(rec.records), storages.next_id, len(self.resizes.events)
        out = run()
        tensors = made(out) if made is not None else ()
        keys = roles if isinstance(roles, tuple) else self.role_keys(roles)
        template = None if tensors is None else _learn(rec, keys, start, first_sid,
                                                       out if returns_buffer else None, tensors)
        resizes = self.resizes.events[events:]
        if template is not None and made is not None:  # the made storages' resizes, replayed as they were
            where = {storages.id_of(t): j for j, t in enumerate(tensors)}
            template = None if any(sid not in where for sid, _, _ in resizes) else dataclasses.replace(
                template, made_events=tuple((where[sid], index - start, a) for sid, index, a in resizes))
        elif template is not None and resizes != [(storages.id_of(t), start, True) for t in resized]:
            template = None  # a resize the replay would not make
        previous = self.seen.get(key, _UNSEEN)
        if template is None or (previous is not _UNSEEN and previous.comparable() != template.comparable()):
            self.seen[key] = None
        elif previous is _UNSEEN:
            self.seen[key] = template
        else:
            self.proven.add(key)
        return out

    # -- replaying -----------------------------------------------------------------------------

    def _emit(self, template: _Template, roles: dict, made: dict, pause_at=None, pause=None) -> int:
        """Append the template's records for these roles; ``made``: born key -> the tensor the
        replay made for it; ``pause()`` runs once the record at relative index ``pause_at`` is
        appended. Returns the index of the first record."""
        rec, storages = self.recorder, self.recorder.storages
        base = len(rec.records)
        born: dict = {}

        def ref(x):
            if isinstance(x, Slot):
                return rec.ref(roles[x])
            return _mapped(x, base) if x.is_record else x

        def store(key):
            if isinstance(key, Slot):
                return storages.id_of(roles[key])
            sid = born.get(key)
            if sid is None:
                sid = born[key] = storages.id_of(made[key]) if key in made else storages.synthetic(
                    template.born_bytes[key])
            return sid

        for i, entry in enumerate(template.records):  # each entry the origin of its replicas (the same costs)
            op, args, kwargs, outputs, rg = entry
            rec.append(op, map_nested(args, ref, (Ref, Slot)), map_nested(kwargs, ref, (Ref, Slot)),
                       _stored(outputs, store), rg, entry)
            if i == pause_at:
                pause()
        for key, index in template.deaths.items():
            storages.deaths[born[key]] = base + index
        self.replayed += 1
        return base


def _stored(val, store):
    """An op's outputs with each TensorMeta's storage replaced by ``store(storage)``. (A module
    function, not a closure calling itself: such a closure is a reference cycle, and the tensors
    its enclosing call holds would live until the garbage collector runs, not until FSDP2 drops
    them.)"""
    if isinstance(val, tuple):
        return tuple(_stored(v, store) for v in val)
    if isinstance(val, TensorMeta):
        return TensorMeta(val.shape, val.stride, val.dtype, store(val.storage), val.storage_nbytes, val.requires_grad)
    return val


def _mapped(ref: Ref, base: int) -> Ref:
    return Ref(base + ref.source, ref.index)


def _learn(rec, roles: tuple, start: int, first_sid: int, result, made=()) -> _Template | None:
    """The records the call made, in template space; None if one reads or makes anything else
    than its roles' tensors (``roles``: their role_keys) and its own, or if a tensor of ``made`` is
    not one of its records' outputs whose storage it made and did not free."""
    storages = rec.storages
    records = rec.records[start:]
    ext_refs, ext_store = roles
    order: dict = {}
    foreign = []

    def ref(r: Ref):
        if r.is_record and r.source >= start:
            return Ref(r.source - start, r.index)
        slot = ext_refs.get(r)
        if slot is None:
            foreign.append(r)
        return slot

    def store(sid):
        if sid in ext_store:
            return ext_store[sid]
        if sid < first_sid:
            foreign.append(sid)
        return order.setdefault(sid, ("born", len(order)))

    out = [(r.op, map_nested(r.args, ref, Ref), map_nested(r.kwargs, ref, Ref), _stored(r.outputs, store),
            r.args_requires_grad) for r in records]
    if foreign or len({r.phase for r in records}) > 1:
        return None
    deaths = {order[sid]: index - start for sid, index in storages.deaths.items() if sid in order
              and start <= index}
    born_bytes = {key: storages.nbytes[sid] for sid, key in order.items()}
    found = None
    if result is not None:
        buffer = result.all_gather_output
        tag = getattr(buffer, TAG, None)
        key = order.get(storages.id_of(buffer))
        if tag is None or not tag.is_record or tag.source < start or key is None or key in deaths \
                or result.all_gather_work is not None:
            return None
        fields = {k: v for k, v in result._asdict().items()
                  if k not in ("all_gather_output", "all_gather_event", "all_gather_work")}
        found = (Ref(tag.source - start, tag.index), key, (type(result), tuple(buffer.shape), buffer.dtype, fields))
    kept = []
    for t in made:
        tag, key = getattr(t, TAG, None), order.get(storages.id_of(t))
        if tag is None or not tag.is_record or tag.source < start or key is None or key in deaths \
                or t.untyped_storage().nbytes() != born_bytes[key]:
            return None
        kept.append((Ref(tag.source - start, tag.index), key))
    role_deaths = {slot: storages.deaths[sid] - start for sid, slot in ext_store.items()
                   if storages.deaths.get(sid, -1) >= start}
    return _Template(out, born_bytes, deaths, found, tuple(kept), role_deaths=role_deaths)


def _gather_key(fsdp_params, group, comm):
    shards = [tp.fsdp_param_shard(p) for p in fsdp_params]
    if any(s is None for s in shards):
        return None
    return ("gather", id(group), type(comm), tuple(
        (tuple(s.shape), s.stride(), s.dtype, p.param_dtype) for s, p in zip(shards, fsdp_params)))


def _copy_out_key(result, fsdp_params, group):
    if result.all_gather_work is not None or any(
            len(p.all_gather_outputs) != 1 or p.fsdp_placement.dim != 0 for p in fsdp_params):
        return None  # not gathered yet (the first copy-out makes the storages), or not a plain dim-0 shard
    buffer = result.all_gather_output
    return ("copy_out", id(group), tuple(buffer.shape), buffer.dtype, tuple(
        (tuple(p.all_gather_outputs[0].shape), p.all_gather_outputs[0].dtype) for p in fsdp_params),
        _plain(result.param_all_gather_input_numels), _plain(result.all_gather_input_split_sizes))


def _first_copy_out_key(result, fsdp_params, group):
    """The key of a block's first copy-out, which makes its parameters' gathered storages (one
    plain dim-0 shard each); None for any other copy-out."""
    if result.all_gather_work is not None or any(
            len(p.all_gather_outputs) != 0 or p.fsdp_placement.dim != 0 for p in fsdp_params) \
            or any(len(n) != 1 for n in result.param_all_gather_input_numels):
        return None
    buffer = result.all_gather_output
    return ("first_copy_out", id(group), tuple(buffer.shape), buffer.dtype,
            _plain(result.param_all_gather_input_numels), _plain(result.param_all_gather_input_dtypes),
            _plain(result.all_gather_input_split_sizes))


def _plain(x):
    return tuple(_plain(v) for v in x) if isinstance(x, (list, tuple)) else x


@contextlib.contextmanager
def gathers_replayed(replay: GatherReplay | None):
    if replay is None:
        yield
        return
    with replay.installed():
        yield
