"""The autograd node a replayed block is (fxacct.trace.replay_train): its forward appends the
template's forward records and returns fresh fake outputs; its backward, when the engine reaches
it, appends the template's backward records and returns fresh gradients."""

from __future__ import annotations

import torch

from fxacct.trace import torch_private as tp
from fxacct.trace.fake_mode import fresh
from fxacct.trace.grad_layout import as_layout
from fxacct.trace.records import TAG, Ref, Slot
from fxacct.trace.replay_template import Template, find_meta


class ReplayFn(torch.autograd.Function):
    """One autograd node for a whole replayed block."""

    @staticmethod
    def forward(ctx, replay, template: Template, block, fqn, inputs, params, *tensors):
        rec = replay.recorder
        local = {n: tp.local(p) for n, p in params.items()}
        refs = {Slot("param", n): getattr(p, TAG) for n, p in local.items()}
        refs.update({Slot("in", j): getattr(x, TAG) for j, x in enumerate(inputs)})
        stores = {Slot("param", n): replay.storages.id_of(p) for n, p in local.items()}
        stores.update({Slot("in", j): replay.storages.id_of(x) for j, x in enumerate(inputs)})
        base = len(rec.records)
        outs = []
        with rec.suppressed():
            for ref, sid in zip(template.out_refs, template.out_storages):
                meta = find_meta(template, ref)
                new = fresh(replay.mode, meta.shape, meta.stride, meta.dtype)
                setattr(new, TAG, Ref(base + ref.source, ref.index))
                stores[sid] = replay.storages.id_of(new)
                outs.append(new)
        replay.emit(template, 0, template.fwd_len, refs, stores, fqn, None)
        for sid, death in template.deaths.items():
            if death < template.fwd_len and sid in stores:
                replay.storages.deaths[stores[sid]] = base + death
        ctx.replay, ctx.template, ctx.fqn, ctx.base = replay, template, fqn, base
        ctx.refs, ctx.stores = refs, stores
        ctx.n_inputs = len(inputs)
        ctx.param_names = list(params)
        ctx.save_for_backward(*[inputs[j] for j in template.saved_inputs])
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    @tp.torch_function_off  # fxacct's bookkeeping alone (tp.no_torch_function)
    def backward(ctx, *gouts):
        replay, template = ctx.replay, ctx.template
        rec = replay.recorder
        refs, stores = dict(ctx.refs), dict(ctx.stores)
        with rec.suppressed():
            gouts = [g if g is not None else torch.zeros(ref_meta.shape, dtype=ref_meta.dtype, device="cpu")
                     for g, ref_meta in zip(gouts, (find_meta(template, r) for r in template.out_refs))]
        for j, g in enumerate(gouts):
            refs[Slot("gout", j)] = rec.ref(g)
            stores[Slot("gout", j)] = replay.storages.id_of(g)
        base = len(rec.records)
        results = {}
        with rec.suppressed():
            for key, gref in zip(template.targets, template.grads):
                if gref is None:
                    continue
                if isinstance(gref, Slot) and gref.kind == "gout":
                    results[key] = gouts[gref.key]
                    continue
                meta = find_meta(template, gref)
                new = fresh(replay.mode, meta.shape, meta.stride, meta.dtype)
                setattr(new, TAG, Ref(base + gref.source - template.fwd_len, gref.index))
                stores[meta.storage] = replay.storages.id_of(new)
                results[key] = new
        replay.emit(template, template.fwd_len, len(template.records), refs, stores, ctx.fqn, ctx.base)
        # the engine frees an incoming gradient once the block's last op that reads it has run,
        # unless something else holds it (a residual's other branch, whose gradient is the same
        # tensor, waits in the input buffer of the op before the block); here the engine holds it
        # until this function returns, so where it is freed then, it died at its last use in the
        # template (the probe held its own incoming gradients to the end), else when it is freed.
        # The block's saved inputs likewise: the engine lets a node's saved tensors go once it has
        # run, where ctx holds them to the end of the whole block's backward
        held = [(Slot("gout", j), last) for j, last in template.gout_last_use.items() if j < len(gouts)]
        held += [(Slot("in", j), last) for j, last in template.input_release.items()]
        for slot, last in held:
            sid = stores[slot]
            death = max(base + last - template.fwd_len, replay.storages.released.get(sid, (-1,))[0])
            replay.storages.released[sid] = (death, len(rec.records) - 1)
        for sid, death in template.deaths.items():
            if sid in stores:
                new_death = ctx.base + death if death < template.fwd_len else base + death - template.fwd_len
                replay.storages.deaths[stores[sid]] = new_death
        # what outlived the probe (autocast's cached low-precision copies of the parameters, kept
        # until the autocast region ends): dies at its last use here, but not before the forward
        # ends (finish() raises it there)
        for sid, last in template.lingering.items():
            if sid in stores:
                replay.storages.deaths[stores[sid]] = ctx.base + last if last < template.fwd_len \
                    else base + last - template.fwd_len
                replay.lingering.add(stores[sid])
        grads = [results.get(Slot("in", j)) for j in range(ctx.n_inputs)]
        layouts = dict(zip(template.targets, template.grad_layouts))
        with rec.suppressed():
            grads += [as_layout(results.get(Slot("param", n)), layouts.get(Slot("param", n)))
                      for n in ctx.param_names]
        return (None, None, None, None, None, None, *grads)


__all__ = ["ReplayFn"]
