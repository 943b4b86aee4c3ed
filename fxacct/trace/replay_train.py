"""Repeated blocks traced once in a training step: forward *and* backward replayed from a probe.

A training step's backward runs the blocks in reverse, after every forward, so a block cannot be
replayed from the first blocks traced in place (their backward comes last). Instead, when the
first block of a run is called, fxacct traces the first two blocks *in isolation* — each on
fresh fake inputs of the actual inputs' shapes, strides, dtypes and requires_grad, its forward
and then `torch.autograd.grad` of its outputs against fake incoming gradients — and compares the
two traces op for op (arguments' relative places, shapes, strides, dtypes, storage lifetimes,
which storages autograd saved). Only when they match does every block of the run go through
`ReplayFn` (fxacct.trace.replay_node): one autograd node whose forward appends the template's
forward records (the block's own module names, parameters, inputs, fresh storages) and returns
new fake outputs, and whose
backward, when the engine reaches it, appends the template's backward records and returns
fresh gradients. A block's backward ops run contiguously in the eager engine too (they all have
higher sequence numbers than the block before it), so the order of ops is the same.

What counts as identical before any op is compared is fxacct.trace.replay's rule (class, parameters,
plain attributes, no shared parameters). Under autocast, each parameter's low-precision copy sits in
autocast's cache until the region ends, outside the block, so a probe cannot see it die: a
replayed copy dies at its last use, but not before the forward ends (``TrainReplay.finish``); a
probe casts stand-ins (``_own_casts``). The inputs the template saved for backward are saved by
`ReplayFn` too, so they live as they would. `--no-dedup` traces every block; tests check both
ways agree. A block called where another saved-tensor hook is in force (inside the model's own
torch.utils.checkpoint, or save_on_cpu), or one that checkpoints inside itself, is traced in full:
a replay would save past that hook what it saves.

Under --mesh (fxacct.parallel) the blocks may be FSDP2-wrapped: FSDP2 gathers a block's parameters
in its pre-forward hook and frees them after, so such blocks are probed one at a time inside their
own calls (the first two calls make the template; the first block replays its own probe, the
others the second's).
FSDP2's hooks still run around every block, replayed or not: its gathers, frees, backward
prefetches and reduce-scatters are recorded as they happen. A DTensor parameter's gradient is
made a DTensor of the probe's gradient placements; a block whose input autograd saves only
through a DTensor (sequence parallelism) is traced in full.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from fxacct.trace import torch_private as tp
from fxacct.trace.dispatch_recorder import BACKWARD, FORWARD
from fxacct.trace.grad_layout import layout_of
from fxacct.trace.known_values import VALUE, known
from fxacct.trace.records import TAG, DerivedFromRecord, OpRecord, Ref, Slot, TensorMeta, TookSequenceNumbers
from fxacct.trace.replay import ForwardPatches, _has_dtensor, _Mismatch, _param_meta
from fxacct.trace.replay_node import ReplayFn
from fxacct.trace.replay_template import (
    Template,
    block_mapper,
    comparable,
    last_uses,
    lingering,
    norm_refs,
    released_at,
    tagged,
    tags_kept,
    to_template_space,
)


class TrainReplay(ForwardPatches):
    """Installed on the blocks of every run for the length of one training capture."""

    def __init__(self, recorder, storages, runs, mode, saved_tracker):
        super().__init__(recorder, storages, runs, mode)
        self.saved = saved_tracker
        self.lingering: set[int] = set()

    def finish(self) -> None:
        """After the trace: a storage that outlived its probe lives at least to the forward's end
        (the autocast region, whose cache held it, closes there)."""
        forward_end = max((i for i, r in enumerate(self.recorder.records) if r.phase == FORWARD), default=-1)
        for sid in self.lingering:
            self.storages.deaths[sid] = max(self.storages.deaths.get(sid, forward_end), forward_end)

    @staticmethod
    def _new_state(run) -> dict:
        return {"template": None, "tried": False, "run": run}

    def _call(self, block, fqn, pos, state, original, args, kwargs):
        if tp.top_saved_tensors_pack() != self.saved.pack:
            # inside torch.utils.checkpoint (or the model's own saved-tensor hooks): a replay would
            # save past them what they save, and a probe's backward would break the checkpoint's frame
            return original(*args, **kwargs)
        leaves, spec = tp.tree_flatten((args, kwargs))
        if _has_dtensor(leaves):  # a DTensor between blocks: its shard is no fresh tensor
            state["tried"], state["template"] = True, None
            return original(*args, **kwargs)
        own = None  # a probe of this very call: the block's own template
        if _gathered_in_hooks(block):
            own = self._learn_in_place(state, pos, fqn, block, leaves, spec)
        elif not state["tried"]:
            state["tried"] = True
            state["template"] = self._learn(state["run"], leaves, spec)
        template = state["template"] or own
        if template is not None and torch.is_grad_enabled():
            with tp.no_torch_function():  # fxacct's bookkeeping alone until the block's own forward
                params = dict(block.named_parameters())
                if self._inputs_match(template, leaves, spec) and template.param_meta == _param_meta(params):
                    return self._replay(template, block, fqn, leaves, params)
        return original(*args, **kwargs)

    def _learn_in_place(self, state, pos, fqn, block, leaves, spec) -> Template | None:
        """FSDP2 gathers a block's parameters in its pre-forward hook and frees them after, so the
        two blocks are probed one at a time, each inside its own call, in order. Returns this
        call's probe, which the block replays (before, or without, a proven template)."""
        if state["tried"] or pos > 1 or not torch.is_grad_enabled():
            state["tried"] = True
            return None
        try:
            probe = self._probe((fqn, block), leaves, spec, views=False)
        except _Mismatch:
            probe = None
        if pos == 0:
            state["first"] = probe
            return probe
        state["tried"] = True
        first = state.pop("first", None)
        if first is not None and probe is not None and comparable(first) == comparable(probe):
            state["template"] = probe
        return probe

    @staticmethod
    def _in_meta(leaves):
        # whether a value is known (fxacct.trace.known_values) too: a check on it can take another branch
        return [(tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad, known(x) is not None)
                for x in leaves if isinstance(x, torch.Tensor)]

    def _inputs_match(self, template, leaves, spec) -> bool:
        plain = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        return spec == template.spec and plain == template.plain and self._in_meta(leaves) == template.in_meta

    # -- learning a template from two isolated blocks ------------------------------------------

    def _learn(self, run, leaves, spec) -> Template | None:
        if not torch.is_grad_enabled():
            return None
        try:
            first = self._probe(run[0], leaves, spec)
            second = self._probe(run[1], leaves, spec)
        except _Mismatch:
            return None
        if first is None or second is None or comparable(first) != comparable(second):
            return None
        return second

    @contextlib.contextmanager
    def _isolated(self):
        rec = self.recorder
        saved = (rec.records, rec.phase, rec.module_stack, self.storages.clock, self.storages.deaths)
        rec.records, rec.module_stack, rec.packs_seen = [], [rec.module_stack[-1]], set()
        self.storages.deaths = {}
        try:
            yield rec.records
        finally:
            rec.records, rec.phase, rec.module_stack, self.storages.clock, self.storages.deaths = saved
            rec.packs_seen = None

    def _probe(self, item, leaves, spec, views: bool = True) -> Template | None:
        """A trace of ``item``'s block on fresh inputs like ``leaves``, forward and backward, in
        template space; None where it cannot stand for the block (``_stands_in``)."""
        fqn, block = item
        rec = self.recorder
        params = {n: p for n, p in block.named_parameters()}
        first_sid = self.storages.next_id
        # the parameters' own refs may be record indices of the step (FSDP2 gathers them there),
        # which a probe's own records would shadow: inside the probe they are the probe's slots
        with self._isolated() as records, _own_casts(block, params, rec) as params, \
                tagged({n: tp.local(p) for n, p in params.items()}), tags_kept([tp.local(b) for b in block.buffers()]):
            fresh, inputs = self._fresh_inputs(leaves)
            args, kwargs = tp.tree_unflatten(fresh, spec)
            rec.module_stack.append(fqn)
            rec.phase = FORWARD
            output = type(block).forward(block, *args, **kwargs)
            rec.module_stack.pop()
            fwd_len = len(records)
            out_leaves, out_spec = tp.tree_flatten(output)
            outs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
            if not self._stands_in(outs, inputs, views):
                return None
            gouts, keys, grads = self._probe_backward(outs, inputs, params)
            deaths = dict(self.storages.deaths)
            saved_now = dict(self.saved.saved)
        # refs and storages in template space
        # (a DTensor's shard: what the ops read; its refs were the probe's slots, tagged)
        ext_store = {self.storages.id_of(tp.local(p)): Slot("param", n) for n, p in params.items()}
        for j, x in enumerate(inputs):
            ext_store.setdefault(self.storages.id_of(x), Slot("in", j))
        for j, g in enumerate(gouts):
            ext_store.setdefault(self.storages.id_of(g), Slot("gout", j))
        normalized = to_template_space(records, fqn, {}, ext_store)
        born = {sid for sid in range(first_sid, self.storages.next_id)}
        saved_inputs = [j for j, x in enumerate(inputs) if self.storages.id_of(x) in saved_now]
        layouts = [layout_of(g) for g in grads]  # a DTensor gradient's own placements (Partial, ...)
        grads = [tp.local(g) for g in grads]
        grad_refs = [None if getattr(g, TAG, None) is None else norm_refs(getattr(g, TAG), {}) for g in grads]
        return Template(
            fqn, normalized, fwd_len, self._in_meta(leaves),
            [None if isinstance(x, torch.Tensor) else x for x in leaves], spec, out_spec,
            [Slot("out", i) if isinstance(x, torch.Tensor) else x for i, x in enumerate(out_leaves)],
            [getattr(x, TAG) for x in outs], [self.storages.id_of(x) for x in outs],
            grad_refs, keys, {s: d for s, d in deaths.items() if s in born}, born,
            {s: v for s, v in saved_now.items() if s in born}, saved_inputs,
            {s: self.storages.nbytes[s] for s in born},
            last_uses(normalized, "gout"),
            lingering(normalized, born, deaths, {self.storages.id_of(x) for x in outs},
                       {self.storages.id_of(g) for g in grads if g is not None}),
            _param_meta(params), layouts, released_at(normalized, fwd_len, saved_inputs),
        )

    def _probe_backward(self, outs, inputs, params) -> tuple[list, list, tuple]:
        """A probe's backward: (the fake incoming gradients, the Slots of what needs a gradient,
        the gradients). Raises _Mismatch where the block cannot be replayed: a checkpointed region
        inside it (its pack hook was in force at some op), or reentrant checkpointing, which
        refuses torch.autograd.grad (the block is traced in full, where a genuine error comes back)."""
        rec = self.recorder
        with rec.suppressed():
            gouts = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu") for x in outs]
        for j, g in enumerate(gouts):
            setattr(g, TAG, Ref(Slot("probe-gout", j)))
        keys = [Slot("in", j) for j, x in enumerate(inputs) if x.requires_grad]
        keys += [Slot("param", n) for n, p in params.items() if p.requires_grad]
        targets = [inputs[k.key] if k.kind == "in" else params[k.key] for k in keys]
        rec.phase = BACKWARD
        try:
            grads = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
        except RuntimeError as e:
            raise _Mismatch from e
        if rec.packs_seen != {self.saved.pack}:
            raise _Mismatch
        return gouts, keys, grads

    def _stands_in(self, outs, inputs, views: bool) -> bool:
        """Whether a probe whose block returned ``outs`` can stand for it: fresh outputs that
        require grad, no input saved only as a DTensor's shard (a lifetime not the template's)
        and, unless ``views``, no view: FSDP2 hooks its pre-backward on a block's outputs, which
        an in-place op on a view drops, and a replayed block returns no view."""
        return bool(outs) and all(x.requires_grad for x in outs) \
            and not any(self.storages.id_of(x) in self.saved.wrapped for x in inputs) \
            and all(getattr(x, TAG, None) is not None and getattr(x, TAG).is_record for x in outs) \
            and (views or not any(x._is_view() for x in outs))

    def _fresh_inputs(self, leaves) -> tuple[list, list]:
        """New fake tensors like the block's inputs (unrecorded), tagged as the probe's inputs."""
        with self.recorder.suppressed():
            fresh = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
                     .requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves]
        inputs = [x for x in fresh if isinstance(x, torch.Tensor)]
        for j, x in enumerate(inputs):
            setattr(x, TAG, Ref(Slot("probe-in", j)))
        for x, y in zip(leaves, fresh):  # a probe sees the values the block would see
            if isinstance(x, torch.Tensor) and known(x) is not None:
                setattr(y, VALUE, known(x))
        return fresh, inputs

    # -- replaying a block ---------------------------------------------------------------------

    def _replay(self, template: Template, block, fqn: str, leaves, params: dict):
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        rec, lo = self.recorder, tp.next_autograd_number()
        base = len(rec.records)
        flat = ReplayFn.apply(self, template, block, fqn, inputs, params, *inputs, *params.values())
        flat = list(flat)
        out = [flat.pop(0) if isinstance(x, Slot) and x.kind == "out" else x for x in template.out_leaves]
        hi = rec.last_seq = tp.next_autograd_number()
        if hi != lo:  # the replay's autograd node: what runs under it (FSDP2's backward hooks) is the block's
            i = base + template.out_refs[0].source  # the op that made the block's output, as in a full trace
            rec.records[i] = replace(rec.records[i], link=TookSequenceNumbers(lo, hi))
        self.replayed += 1
        return tp.tree_unflatten(out, template.out_spec)

    def emit(self, template: Template, start: int, stop: int, refs: dict, stores: dict, fqn: str,
             fwd_base: int | None) -> int:
        """Append template records [start, stop) with refs and storages mapped; return the index
        the first one got."""
        rec = self.recorder
        base = len(rec.records)
        mapped = block_mapper(refs, (base if fwd_base is None else fwd_base, base, template.fwd_len))
        for i in range(start, stop):
            r = template.records[i]
            link, module = r.link, r.module
            if r.phase == BACKWARD:
                link = DerivedFromRecord(fwd_base + link.index) if link is not None else None
            else:
                module = fqn + module if not module.startswith("\0") else module[1:]
            rec.records.append(OpRecord(r.op, mapped(r.args), mapped(r.kwargs),
                                        self._map_val(r.outputs, stores, template), r.phase, module, link,
                                        r.args_requires_grad, r.scope, r))
            self.storages.clock = len(rec.records) - 1
        return base

    def _map_val(self, val, stores, template):
        if isinstance(val, tuple):
            return tuple(self._map_val(v, stores, template) for v in val)
        if not isinstance(val, TensorMeta):
            return val
        where = val.storage
        if isinstance(where, Slot):  # the block's own parameter, input or incoming gradient
            sid = stores[where]
        elif where in template.born:
            sid = stores.get(where)
            if sid is None:
                sid = stores[where] = self.storages.synthetic(template.storage_bytes[where])
                if where in template.saved:
                    self.saved.saved[sid] = template.saved[where]
        else:
            sid = where  # a storage from outside the block (a shared table)
        return TensorMeta(val.shape, val.stride, val.dtype, sid, val.storage_nbytes, val.requires_grad)


@contextlib.contextmanager
def _own_casts(block, params: dict, recorder):
    """The parameters a probe's forward reads: under autocast, stand-ins (detached leaves of the
    same storages). Autocast caches a leaf parameter's low-precision copy until its region ends; a
    probe casting the block's own parameters would leave copies for the block's traced forward
    (an FSDP2 block is traced right after its probe, any block when the probes disagree): no cast
    recorded there, and its products reading tensors of the discarded probe."""
    if not torch.is_autocast_enabled("cpu"):
        yield params
        return
    with recorder.suppressed():
        stand_ins = {n: p.detach().requires_grad_(p.requires_grad) for n, p in params.items()}
    with tp.reparametrize_module(block, stand_ins, tie_weights=True):
        yield stand_ins


def _gathered_in_hooks(block) -> bool:
    """Whether ``block`` is FSDP2-wrapped (``fully_shard``): its parameters are gathered only
    while its own call runs."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(block, fsdp.FSDPModule)
