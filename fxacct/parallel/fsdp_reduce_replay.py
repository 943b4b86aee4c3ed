"""FSDP2's reduce-scatters replayed: after each block's backward, ``foreach_reduce`` copies the
block's unsharded gradients into one buffer, reduce-scatters it and hands each sharded parameter
its gradient's shard as ``.grad``: the same ops block after block, so, as its gathers
(fxacct.parallel.fsdp_replay, whose GatherReplay this serves), its first two calls of a key are
traced and compared and the later ones appended from the template.

A call replays only where it does nothing else: a reduce-scatter group of more than one rank and
no all-reduce (no HSDP, no replicate), no hook, no partial output of an earlier accumulation step,
no divide factor of its own, every gradient of one dtype reduced and handed back in that dtype,
and every parameter a plain dim-0 shard on the device, without a gradient yet (its first
backward) or a post-accumulate-grad hook. What the traced call returned must be what torch 2.13's
returns (the input buffer, its event, the stream, an event and three Nones); another release's
is traced every time. Replayed, the two buffers are made unrecorded, the parameters' gradients
are views of the output buffer (the template's ``as_strided`` arguments) wrapped by FSDP2's own
``to_sharded_dtensor``, and the unsharded gradients are dropped where the traced call dropped
them (after its copy into the buffer): their storages die there, as FSDP2 lets them.
"""

from __future__ import annotations

import torch

from fxacct.trace import torch_private as tp
from fxacct.trace.records import Ref, Slot, TensorMeta, iter_nested


def replay_reduce(replay, call):
    """``call`` (a TorchCall of foreach_reduce) traced or replayed by ``replay`` (a GatherReplay)."""
    grads, params = call.get("unsharded_grads"), call.get("fsdp_params")
    key = _key(call) if call.at_defaults_except(tp.FSDP_REDUCE_ARGS) else None
    plan = _plan(replay.seen[key], len(grads)) if key in replay.proven and replay._recording() else None
    if plan is None:
        keys = replay.role_keys({Slot("grad", j): g for j, g in enumerate(grads)})
        return replay._traced(key, keys, call.run, returns_buffer=False, made=lambda out: _made(out, params))
    (clear_at, late), (rs_ref, rs_key, rs_meta), (out_key, out_numel), views = plan
    device, stream = call.get("device"), call.get("reduce_scatter_stream")
    rec = replay.recorder
    with rec.suppressed():
        rs_input = torch.empty(rs_meta.shape, dtype=rs_meta.dtype, device=device)
        output = torch.empty((out_numel,), dtype=rs_meta.dtype, device=device)
        shards = [torch.as_strided(output, *args) for _, args in views]
    roles = {Slot("grad", j): g for j, g in enumerate(grads)}

    def drop_gradients():  # FSDP2 clears the list once they are copied into the buffer
        for slot in set(roles) - set(late):
            del roles[slot]
        grads.clear()

    base = replay._emit(replay.seen[key], roles, {rs_key: rs_input, out_key: output}, clear_at, drop_gradients)
    if clear_at is None:
        drop_gradients()
    # a gradient something else still held died later in the traced call, when that let it go: there
    for slot, index in late.items():
        sid = rec.storages.id_of(roles.pop(slot))
        rec.storages.deaths[sid] = base + index
        rec.storages.pinned.add(sid)
    rec.tag(rs_input, Ref(base + rs_ref.source, rs_ref.index))
    for (ref, _), shard in zip(views, shards):
        rec.tag(shard, Ref(base + ref.source, ref.index))
    with rec.suppressed():
        for p, shard in zip(params, shards):
            p.sharded_param.grad = p.to_sharded_dtensor(shard)
    stream.wait_stream(torch.get_device_module(device.type).current_stream())
    return rs_input, stream.record_event(), stream, stream.record_event(), None, None, None


def _key(call):
    group, grads, params = call.get("reduce_scatter_group"), call.get("unsharded_grads"), call.get("fsdp_params")
    if group is None or group.size() < 2 or call.get("all_reduce_group") is not None \
            or call.get("partial_reduce_output") is not None or call.get("all_reduce_hook") is not None \
            or call.get("gradient_divide_factor") is not None or call.get("force_sum_reduction_for_comms"):
        return None
    dtypes = {g.dtype for g in grads}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
    if dtype is None or call.get("reduce_dtype") not in (None, dtype) or call.get("orig_dtype") not in (None, dtype):
        return None
    if any(p.fsdp_placement.dim != 0 or p.offload_to_cpu or p.sharded_param.grad is not None
           or getattr(p.sharded_param, "_post_accumulate_grad_hooks", None) for p in params):
        return None
    return ("reduce", id(group), type(call.get("reduce_scatter_comm")), dtype,
            tuple((tuple(g.shape), g.stride()) for g in grads),
            tuple((tuple(p.sharded_size), tuple(p.contiguous_sharded_stride)) for p in params))


def _made(out, params):
    """What a traced call made that outlives it: the input buffer, then each parameter's gradient
    shard; None where it returned anything else than torch 2.13's tuple."""
    if not (isinstance(out, tuple) and len(out) == 7 and isinstance(out[0], torch.Tensor)
            and out[4:] == (None, None, None)):
        return None
    grads = [p.sharded_param.grad for p in params]
    if any(g is None for g in grads):
        return None
    return [out[0], *(tp.local(g) for g in grads)]


def _plan(template, n_grads):
    """How to replay ``template``: ((index after which FSDP2 dropped the gradients or None, {role:
    index} of those that died later), (ref, born key, TensorMeta) of the input buffer, (born key,
    numel) of the output buffer, [(ref, as_strided arguments)] per parameter); None where the
    template does not have that form."""
    rs, *views = template.made
    out_keys = {key for _, key in views}
    deaths = template.role_deaths
    if len(out_keys) != 1 or len(deaths) not in (0, n_grads):
        return None
    clear_at = min(deaths.values()) if deaths else None
    late = {slot: index for slot, index in deaths.items() if index != clear_at}
    if clear_at is not None and any(_reads(r, set(deaths) - set(late)) for r in template.records[clear_at + 1:]):
        return None
    plan_views = []
    for ref, _ in views:
        op, args, kwargs, _, _ = template.records[ref.source]
        if op is not torch.ops.aten.as_strided.default or kwargs or ref.index is not None:
            return None
        plan_views.append((ref, tuple(args[1:])))
    rs_meta = template.records[rs[0].source][3]
    if not isinstance(rs_meta, TensorMeta) or rs[0].index is not None:
        return None
    out_key = next(iter(out_keys))
    out_numel = template.born_bytes[out_key] // rs_meta.dtype.itemsize
    return (clear_at, late), (rs[0], rs[1], rs_meta), (out_key, out_numel), plan_views


def _reads(record, roles: set) -> bool:
    _, args, kwargs, _, _ = record
    return any(slot in roles for slot in iter_nested((args, kwargs), Slot))
