"""Repeated blocks traced once in a training step: forward *and* backward replayed from a probe.

A training step's backward runs the blocks in reverse, after every forward, so a block cannot be
replayed from the first blocks traced in place (their backward comes last). Instead, when the
first block of a run is called, fxacct traces the first two blocks *in isolation* — each on
fresh fake inputs of the actual inputs' shapes, strides, dtypes and requires_grad, its forward
and then `torch.autograd.grad` of its outputs against fake incoming gradients — and compares the
two traces op for op (arguments' relative places, shapes, strides, dtypes, storage lifetimes,
which storages autograd saved). Only when they match does every block of the run go through
`_ReplayFn`: one autograd node whose forward appends the template's forward records (the block's
own module names, parameters, inputs, fresh storages) and returns new fake outputs, and whose
backward, when the engine reaches it, appends the template's backward records and returns
fresh gradients. A block's backward ops run contiguously in the eager engine too (they all have
higher sequence numbers than the block before it), so the order of ops is the same.

What counts as identical before any op is compared is fxacct.trace.replay's rule (class, parameters,
plain attributes, no shared parameters). Under autocast, each parameter's low-precision copy sits in
autocast's cache until the region ends, outside the block, so a probe cannot see it die: a
replayed copy dies at its last use, but not before the forward ends (``TrainReplay.finish``). The inputs the template saved for backward are saved by
`_ReplayFn` too, so they live as they would. `--no-dedup` traces every block;
tests check both ways agree.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from fxacct.trace import torch_private as tp
from fxacct.trace.dispatch_recorder import BACKWARD, FORWARD
from fxacct.trace.records import TAG, Ref, TensorMeta
from fxacct.trace.replay import ForwardPatches, _Mismatch, _relative


@dataclass
class _Template:
    fqn: str
    records: list  # forward records then backward records, refs normalized to template space
    fwd_len: int
    in_meta: list  # (shape, stride, dtype, requires_grad) per input tensor leaf
    plain: list  # input leaves, tensors replaced by None
    spec: object
    out_spec: object
    out_leaves: list  # ("out", i) for tensor outputs, plain values otherwise
    out_refs: list  # template ref of each tensor output
    out_storages: list  # template storage id of each tensor output
    grads: list  # per target ("in", j) / ("param", name): template ref of its gradient or None
    targets: list  # keys of the gradient targets, in order
    deaths: dict  # template storage id -> template record index (absent: alive at the end)
    born: set  # storage ids born inside the probe
    saved: dict  # template storage id -> (bytes, dtype) saved by autograd
    saved_inputs: list  # indices of input leaves autograd saved
    storage_bytes: dict  # template storage id -> bytes
    gout_last_use: dict  # incoming gradient j -> index of the last template record reading it
    lingering: dict  # storage alive at the probe's end that is no output or gradient -> last use


class TrainReplay(ForwardPatches):
    """Installed on the blocks of every run for the length of one training capture."""

    def __init__(self, recorder, storages, runs, saved_tracker):
        super().__init__(recorder, storages, runs)
        self.saved = saved_tracker
        self.lingering: set[int] = set()

    def finish(self) -> None:
        """After the trace: a storage that outlived its probe lives at least to the forward's end
        (the autocast region, whose cache held it, closes there)."""
        forward_end = max((i for i, r in enumerate(self.recorder.records) if r[4] == FORWARD), default=-1)
        for sid in self.lingering:
            self.storages.deaths[sid] = max(self.storages.deaths.get(sid, forward_end), forward_end)

    @staticmethod
    def _new_state(run) -> dict:
        return {"template": None, "tried": False, "run": run}

    def _call(self, block, fqn, pos, state, original, args, kwargs):
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        if not state["tried"]:
            state["tried"] = True
            state["template"] = self._learn(state["run"], leaves, spec)
        template = state["template"]
        if template is not None and torch.is_grad_enabled() and self._inputs_match(template, leaves, spec):
            return self._replay(template, block, fqn, leaves)
        return original(*args, **kwargs)

    @staticmethod
    def _in_meta(leaves):
        return [(tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
                for x in leaves if isinstance(x, torch.Tensor)]

    def _inputs_match(self, template, leaves, spec) -> bool:
        plain = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        return spec == template.spec and plain == template.plain and self._in_meta(leaves) == template.in_meta

    # -- learning a template from two isolated blocks ------------------------------------------

    def _learn(self, run, leaves, spec) -> _Template | None:
        if not torch.is_grad_enabled():
            return None
        try:
            first = self._probe(run[0], leaves, spec)
            second = self._probe(run[1], leaves, spec)
        except _Mismatch:
            return None
        if first is None or second is None or _comparable(first) != _comparable(second):
            return None
        return second

    @contextlib.contextmanager
    def _isolated(self):
        rec = self.recorder
        saved = (rec.records, rec.phase, rec.module_stack, self.storages.clock, self.storages.deaths)
        rec.records, rec.module_stack = [], [rec.module_stack[-1]]
        self.storages.deaths = {}
        try:
            yield rec.records
        finally:
            rec.records, rec.phase, rec.module_stack, self.storages.clock, self.storages.deaths = saved

    def _probe(self, item, leaves, spec) -> _Template | None:
        fqn, block = item
        rec = self.recorder
        params = {n: p for n, p in block.named_parameters()}
        first_sid = self.storages.next_id
        with self._isolated() as records:
            with rec.suppressed():
                fresh = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
                         .requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves]
            inputs = [x for x in fresh if isinstance(x, torch.Tensor)]
            for j, x in enumerate(inputs):
                setattr(x, TAG, Ref(("probe-in", j), None))
            args, kwargs = torch.utils._pytree.tree_unflatten(fresh, spec)
            rec.module_stack.append(fqn)
            rec.phase = FORWARD
            output = type(block).forward(block, *args, **kwargs)
            rec.module_stack.pop()
            fwd_len = len(records)
            out_leaves, out_spec = torch.utils._pytree.tree_flatten(output)
            outs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
            if not outs or any(not x.requires_grad for x in outs):
                return None
            if any(getattr(x, TAG, None) is None or not isinstance(getattr(x, TAG).source, int) for x in outs):
                return None  # an input handed back as an output: not a fresh tensor
            with rec.suppressed():
                gouts = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu") for x in outs]
            for j, g in enumerate(gouts):
                setattr(g, TAG, Ref(("probe-gout", j), None))
            keys = [("in", j) for j, x in enumerate(inputs) if x.requires_grad]
            keys += [("param", n) for n, p in params.items() if p.requires_grad]
            targets = [inputs[k[1]] if k[0] == "in" else params[k[1]] for k in keys]
            rec.phase = BACKWARD
            grads = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
            deaths = dict(self.storages.deaths)
            saved_now = dict(self.saved.saved)
        # refs and storages in template space
        ext_refs = {getattr(p, TAG, None): ("param", n) for n, p in params.items()}
        ext_store = {self.storages.id_of(p): ("param", n) for n, p in params.items()}
        for j, x in enumerate(inputs):
            ext_store.setdefault(self.storages.id_of(x), ("in", j))
        for j, g in enumerate(gouts):
            ext_store.setdefault(self.storages.id_of(g), ("gout", j))
        seq_owner = {}
        normalized = []
        for i, (func, a, kw, val, phase, module, link, rg, scope) in enumerate(records):
            if phase == BACKWARD:
                link = ("rec", seq_owner[link]) if link in seq_owner else None
                module = None
            else:
                for s in link:
                    seq_owner[s] = i
                link = range(0)
                module = _relative(module, fqn)
            normalized.append((func, _norm(a, ext_refs), _norm(kw, ext_refs), _norm_val(val, ext_store),
                               phase, module, link, rg, scope))
        born = {sid for sid in range(first_sid, self.storages.next_id)}
        saved_inputs = [j for j, x in enumerate(inputs) if self.storages.id_of(x) in saved_now]
        grad_refs = []
        for g in grads:
            ref = getattr(g, TAG, None) if g is not None else None
            grad_refs.append(_norm(ref, ext_refs) if ref is not None else None)
        return _Template(
            fqn, normalized, fwd_len, self._in_meta(leaves),
            [None if isinstance(x, torch.Tensor) else x for x in leaves], spec, out_spec,
            [("out", i) if isinstance(x, torch.Tensor) else x for i, x in enumerate(out_leaves)],
            [getattr(x, TAG) for x in outs], [self.storages.id_of(x) for x in outs],
            grad_refs, keys, {s: d for s, d in deaths.items() if s in born}, born,
            {s: v for s, v in saved_now.items() if s in born}, saved_inputs,
            {s: self.storages.nbytes[s] for s in born},
            _last_uses(normalized, "gout"),
            _lingering(normalized, born, deaths, {self.storages.id_of(x) for x in outs},
                       {self.storages.id_of(g) for g in grads if g is not None}),
        )

    # -- replaying a block ---------------------------------------------------------------------

    def _replay(self, template: _Template, block, fqn: str, leaves):
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        params = dict(block.named_parameters())
        flat = _ReplayFn.apply(self, template, block, fqn, inputs, params, *inputs, *params.values())
        flat = list(flat)
        out = [flat.pop(0) if isinstance(x, tuple) and x[:1] == ("out",) else x for x in template.out_leaves]
        self.recorder.last_seq = tp.get_sequence_nr()
        self.replayed += 1
        return torch.utils._pytree.tree_unflatten(out, template.out_spec)

    def emit(self, template: _Template, start: int, stop: int, refs: dict, stores: dict, fqn: str,
             fwd_base: int | None) -> int:
        """Append template records [start, stop) with refs and storages mapped; return the index
        the first one got."""
        rec = self.recorder
        base = len(rec.records)
        bases = (base if fwd_base is None else fwd_base, base, template.fwd_len)
        for i in range(start, stop):
            func, a, kw, val, phase, module, link, rg, scope = template.records[i]
            if phase == BACKWARD:
                link = ("rec", fwd_base + link[1]) if link is not None else None
            else:
                module = fqn + module if not module.startswith("\0") else module[1:]
            rec.records.append((func, _map(a, refs, bases), _map(kw, refs, bases),
                                self._map_val(val, stores, template), phase, module, link, rg, scope))
            self.storages.clock = len(rec.records) - 1
        return base

    def _map_val(self, val, stores, template):
        if isinstance(val, tuple):
            return tuple(self._map_val(v, stores, template) for v in val)
        if not isinstance(val, TensorMeta):
            return val
        where = val.storage
        if isinstance(where, tuple):  # ("param", n) / ("in", j): the block's own
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


class _ReplayFn(torch.autograd.Function):
    """One autograd node for a whole replayed block."""

    @staticmethod
    def forward(ctx, replay: TrainReplay, template: _Template, block, fqn, inputs, params, *tensors):
        rec = replay.recorder
        refs = {("param", n): getattr(p, TAG) for n, p in params.items()}
        refs.update({("in", j): getattr(x, TAG) for j, x in enumerate(inputs)})
        stores = {("param", n): replay.storages.id_of(p) for n, p in params.items()}
        stores.update({("in", j): replay.storages.id_of(x) for j, x in enumerate(inputs)})
        base = len(rec.records)
        outs = []
        with rec.suppressed():
            for ref, sid in zip(template.out_refs, template.out_storages):
                meta = _find_meta(template, ref)
                new = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="cpu")
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
    def backward(ctx, *gouts):
        replay, template = ctx.replay, ctx.template
        rec = replay.recorder
        refs, stores = dict(ctx.refs), dict(ctx.stores)
        with rec.suppressed():
            gouts = [g if g is not None else torch.zeros(ref_meta.shape, dtype=ref_meta.dtype, device="cpu")
                     for g, ref_meta in zip(gouts, (_find_meta(template, r) for r in template.out_refs))]
        for j, g in enumerate(gouts):
            refs[("gout", j)] = rec.ref(g)
            stores[("gout", j)] = replay.storages.id_of(g)
        base = len(rec.records)
        results = {}
        with rec.suppressed():
            for key, gref in zip(template.targets, template.grads):
                if gref is None:
                    continue
                if isinstance(gref, tuple) and gref[:1] == ("gout",):
                    results[key] = gouts[gref[1]]
                    continue
                meta = _find_meta(template, gref)
                new = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="cpu")
                setattr(new, TAG, Ref(base + gref.source - template.fwd_len, gref.index))
                stores[meta.storage] = replay.storages.id_of(new)
                results[key] = new
        replay.emit(template, template.fwd_len, len(template.records), refs, stores, ctx.fqn, ctx.base)
        # the engine frees an incoming gradient once the block's last op that reads it has run;
        # here the engine holds it until this function returns, so its death is set from the
        # template (the probe held its own incoming gradients to the end)
        for j, g in enumerate(gouts):
            last = template.gout_last_use.get(j)
            if last is not None:
                sid = stores[("gout", j)]
                replay.storages.deaths[sid] = base + last - template.fwd_len
                replay.storages.pinned.add(sid)
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
        grads = [results.get(("in", j)) for j in range(ctx.n_inputs)]
        grads += [results.get(("param", n)) for n in ctx.param_names]
        return (None, None, None, None, None, None, *grads)


def _last_uses(records, kind: str) -> dict:
    """j -> index of the last record whose arguments read (kind, j)."""
    last = {}

    def walk(a, i):
        if isinstance(a, tuple) and len(a) == 2 and a[0] == kind and isinstance(a[1], int):
            last[a[1]] = i
        elif isinstance(a, dict):
            for v in a.values():
                walk(v, i)
        elif isinstance(a, (list, tuple)):
            for v in a:
                walk(v, i)

    for i, (_, a, kw, *_rest) in enumerate(records):
        walk(a, i)
        walk(kw, i)
    return last


def _lingering(records, born: set, deaths: dict, outputs: set, grads: set) -> dict:
    """Storages born in the probe and alive at its end that are neither its outputs nor its
    gradients, with the index of the last record that produced or read them."""
    keep = {s for s in born if s not in deaths and s not in outputs and s not in grads}
    produced = {}
    last = {}
    for i, (_, a, kw, val, *_rest) in enumerate(records):
        metas = val if isinstance(val, tuple) else (val,)
        mine = {m.storage for m in metas if isinstance(m, TensorMeta)} & keep
        produced[i] = mine
        for sid in mine:
            last[sid] = i
        for ref in _refs((a, kw)):
            for sid in produced.get(ref.source, ()):
                last[sid] = i
    return {sid: last[sid] for sid in keep if sid in last}


def _refs(a):
    if isinstance(a, Ref):
        yield a
    elif isinstance(a, dict):
        for v in a.values():
            yield from _refs(v)
    elif isinstance(a, (list, tuple)):
        for v in a:
            yield from _refs(v)


def _find_meta(template: _Template, ref) -> TensorMeta:
    val = template.records[ref.source][3]
    return val[ref.index] if ref.index is not None else val


def _norm(a, ext_refs):
    if isinstance(a, Ref):
        if isinstance(a.source, tuple) and a.source[0] == "probe-in":
            return ("in", a.source[1])
        if isinstance(a.source, tuple) and a.source[0] == "probe-gout":
            return ("gout", a.source[1])
        return ext_refs.get(a, a)
    if isinstance(a, dict):
        return {k: _norm(v, ext_refs) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return type(a)(_norm(x, ext_refs) for x in a)
    return a


def _norm_val(val, ext_store):
    if isinstance(val, tuple):
        return tuple(_norm_val(v, ext_store) for v in val)
    if not isinstance(val, TensorMeta):
        return val
    where = ext_store.get(val.storage, val.storage)
    return TensorMeta(val.shape, val.stride, val.dtype, where, val.storage_nbytes, val.requires_grad)


def _map(a, refs, bases):
    """Template refs to the replayed block's: its own inputs/parameters/incoming gradients, and its
    own records (``bases``: where its forward and its backward records start, and the template's
    forward length)."""
    if isinstance(a, Ref):
        if not isinstance(a.source, int):
            return refs.get(a, a)
        fwd_base, bwd_base, fwd_len = bases
        index = fwd_base + a.source if a.source < fwd_len else bwd_base + a.source - fwd_len
        return Ref(index, a.index)
    if isinstance(a, tuple) and len(a) == 2 and a[:1] in (("in",), ("param",), ("gout",)):
        return refs[a]
    if isinstance(a, dict):
        return {k: _map(v, refs, bases) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return type(a)(_map(x, refs, bases) for x in a)
    return a


def _comparable(t: _Template):
    """A template with its storage ids renumbered by first appearance, so two probes compare."""
    order: dict = {}

    def sid(s):
        if isinstance(s, tuple) or s not in t.born:
            return s
        return ("born", order.setdefault(s, len(order)), t.deaths.get(s, "alive"), s in t.saved)

    def val(v):
        if isinstance(v, tuple):
            return tuple(val(x) for x in v)
        if isinstance(v, TensorMeta):
            return (v.shape, v.stride, v.dtype, v.requires_grad, sid(v.storage))
        return v

    recs = [(f, a, kw, val(v), ph, m, lk, rg, sc) for f, a, kw, v, ph, m, lk, rg, sc in t.records]
    return (recs, t.fwd_len, t.in_meta, t.plain, t.out_leaves, [sid(s) for s in t.out_storages],
            t.grads, t.targets, t.saved_inputs)
