"""Repeated blocks traced once: the forward of an inference capture replays a proven template.

A model's stack of identical blocks (the items of a ModuleList, Sequential or ModuleDict) costs
the same op for op; tracing each on fake tensors is most of fxacct's time on a 70B model. Here the first two
blocks of a run are traced, their recorded ops compared, and, only when they match, every later
block whose inputs match too is *replayed*: the template's records are appended again with the
block's own module names, parameters, inputs and fresh storages, and the block returns new fake
outputs of the template's shapes. The account is the same op for op, bytes for bytes; `--no-dedup`
turns this off, and tests/test_replay.py checks both ways agree.

What counts as identical, before any op is compared: same class; same parameter and buffer
names, shapes, dtypes and requires_grad; same plain attributes in every submodule; no parameter
shared with anything outside the block. Then the two traced blocks must record the same ops,
arguments, shapes, strides, dtypes and storage lifetimes, with arguments that point at the same
relative places (own inputs, own parameters, own earlier ops).

Labels. An int attribute that differs between blocks (Hugging Face's `layer_idx`) may only label
the block, or it may select what the block does (a sliding window, a RoPE variant, a scale). It
is taken for a label, and blocks that differ only in labels form one run, when all of these hold
(fxacct.trace.replay_runs), else the run splits where the values change (the old, exact rule):
- the first two blocks, the two that are traced and compared op for op, carry *different* values
  of every varying label, so the op comparison is a probe of two values: a value that changes an
  op, an argument (a scale), a shape or a lifetime makes them differ, and nothing replays;
- every per-layer table the blocks can read it through agrees at each block's value: for each
  list, tuple or dict held by an object the blocks reference (a `config`) that has one entry per
  block of the container or a name about layers, the entry at
  the value (`config.layer_types[layer_idx]`), or whether the value is a member
  (`layer_idx in config.mlp_only_layers`), is the same for every block of the run.
What a block's code computes from a label in Python without a table (`layer_idx % 3 == 2`) only
the probe can see; a choice made at construction shows up as a differing attribute, parameter or
class instead. `--no-dedup` traces every block.

Only forward-only (inference) captures replay: a training step's backward runs in reverse, after
every forward, which a replayed block would have to reproduce as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from fxacct.trace import torch_private as tp
from fxacct.trace.fake_mode import fresh
from fxacct.trace.records import NO_NUMBERS, TAG, OpRecord, Ref, Slot, TensorMeta, comparable, map_nested
from fxacct.trace.replay_runs import find_runs  # noqa: F401  (re-exported)


class _Tensor(NamedTuple):
    """What a span keeps of a tensor: never the tensor, which must die when the program drops it."""

    ref: object  # its TAG
    storage: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    requires_grad: bool
    whole: bool  # the tensor covers its whole storage from offset 0


@dataclass
class _Span:
    start: int
    end: int
    inputs: list  # _Tensor per tensor leaf of (args, kwargs)
    leaves: list  # all leaves, tensors replaced by None
    spec: object
    params: dict  # name -> fake tensor (reparametrized; resident anyway)
    first_sid: int  # storages with ids from here on were born inside the span
    param_meta: tuple = ()  # the parameters as the forward sees them (_param_meta)
    output: list | None = None  # leaves: _Tensor or plain values
    output_spec: object = None


class ForwardPatches:
    """Routes each block's forward through ``self._call`` while active; restores every block's
    own forward (an instance attribute only shadows the class method) on exit."""

    def __init__(self, recorder, storages, runs, mode):
        self.recorder = recorder
        self.mode = mode  # the capture's FakeTensorMode: a replay's fresh tensors are its (fake_mode.fresh)
        self.storages = storages
        self.runs = runs
        self.installed: list[tuple[torch.nn.Module, object]] = []
        self.replayed = 0

    def __enter__(self):
        for run in self.runs:
            state = self._new_state(run)
            for pos, (fqn, block) in enumerate(run):
                self._install(block, fqn, pos, state)
        return self

    def __exit__(self, *exc):
        for block, previous in self.installed:
            if previous is None:
                del block.forward
            else:
                block.forward = previous

    def _install(self, block, fqn, pos, state):
        previous = block.__dict__.get("forward")
        original = block.forward

        def forward(*args, **kwargs):
            return self._call(block, fqn, pos, state, original, args, kwargs)

        block.forward = forward
        self.installed.append((block, previous))


class BlockReplay(ForwardPatches):
    """Installed on the blocks of every run for the length of one inference capture."""

    @staticmethod
    def _new_state(run) -> dict:
        return {"spans": [], "template": None, "ok": True}

    @tp.torch_function_off
    def _describe(self, t: torch.Tensor) -> _Tensor:
        st = t.untyped_storage()
        return _Tensor(getattr(t, TAG, None), self.storages.id_of(t), tuple(t.shape), tuple(t.stride()),
                       t.dtype, t.requires_grad,
                       t.storage_offset() == 0 and st.nbytes() == t.numel() * t.element_size())

    @tp.torch_function_off  # fxacct's own reads (tp.no_torch_function), as _replay's and _describe's
    def _span(self, block, args, kwargs) -> tuple[_Span, list]:
        leaves, spec = tp.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        plain = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        params = dict(block.named_parameters())
        params.update(("buffer:" + n, b) for n, b in block.named_buffers())
        span = _Span(len(self.recorder.records), -1, [self._describe(t) for t in tensors], plain, spec, params,
                     self.storages.next_id, _param_meta(params))
        return span, tensors

    def _call(self, block, fqn, pos, state, original, args, kwargs):
        if _has_dtensor((args, kwargs)):  # a DTensor between blocks: its shard is no fresh tensor
            state["ok"] = False
            return original(*args, **kwargs)
        span, inputs = self._span(block, args, kwargs)
        template = state["template"]
        if pos >= 2 and state["ok"] and template is not None and self._inputs_match(template, span):
            try:
                return self._replay(template, span, inputs, state["template_fqn"], fqn)
            except _Mismatch:
                state["ok"] = False
        output = original(*args, **kwargs)
        if _has_dtensor(output):
            state["ok"] = False
            return output
        span.end = len(self.recorder.records)
        leaves, span.output_spec = tp.tree_flatten(output)
        span.output = [self._describe(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        if pos < 2:
            state["spans"].append((pos, fqn, span))
            if pos == 1:
                spans, state["spans"] = state["spans"], []
                if [p for p, _, _ in spans] != [0, 1]:  # called out of order: no template
                    state["ok"] = False
                    return output
                (_, fqn0, span0), (_, fqn1, span1) = spans
                if span0.param_meta == span1.param_meta and \
                        self._normalized(span0, fqn0) == self._normalized(span1, fqn1):
                    state["template"], state["template_fqn"] = span1, fqn1
                else:
                    state["ok"] = False
        return output

    @staticmethod
    def _inputs_match(template: _Span, span: _Span) -> bool:
        def meta(t: _Tensor):
            return t.shape, t.stride, t.dtype, t.requires_grad

        return (template.spec == span.spec and template.leaves == span.leaves and template.param_meta == span.param_meta
                and [meta(t) for t in template.inputs] == [meta(t) for t in span.inputs])

    # -- comparing two traced blocks --------------------------------------------------------

    def _external(self, span: _Span):
        refs, stores = {}, {}
        for j, t in enumerate(span.inputs):
            refs.setdefault(t.ref, Slot("arg", j))
            stores.setdefault(t.storage, Slot("arg", j))
        for name, p in span.params.items():
            p = tp.local(p)  # a DTensor parameter: its shard on this rank, which the ops read
            refs.setdefault(getattr(p, TAG, None), Slot("param", name))
            stores.setdefault(self.storages.id_of(p), Slot("param", name))
        return refs, stores

    def _normalized(self, span: _Span, fqn: str):
        refs, stores = self._external(span)
        born: dict[int, int] = {}
        out = []
        records = self.recorder.records[span.start:span.end]
        for i, r in enumerate(records):
            metas = r.outputs if isinstance(r.outputs, tuple) else (r.outputs,)
            norm_val = []
            for v in metas:
                if isinstance(v, TensorMeta):
                    if v.storage in stores:
                        where = stores[v.storage]
                    elif v.storage < span.first_sid:
                        where = ("ext", v.storage)
                    else:
                        where = ("born", born.setdefault(v.storage, i))
                        death = self.storages.deaths.get(v.storage)
                        where += (death - span.start if death is not None and death < span.end else "alive",)
                    norm_val.append((v.shape, v.stride, v.dtype, v.requires_grad, where))
                else:
                    norm_val.append(v)
            out.append((r.op, comparable(self._norm_args(r.args, span, refs)),
                        comparable(self._norm_args(r.kwargs, span, refs)),
                        tuple(norm_val), r.phase, _relative(r.module, fqn), r.args_requires_grad,
                        len(r.link.numbers()), r.scope))
        outputs = [(self._norm_ref(x.ref, span, refs), x.shape, x.stride, x.dtype, x.whole)
                   if isinstance(x, _Tensor) else x for x in span.output]
        return out, outputs, span.output_spec

    def _norm_ref(self, ref, span, refs):
        if isinstance(ref, Ref) and isinstance(ref.source, int) and span.start <= ref.source < span.end:
            return ("op", ref.source - span.start, ref.index)
        if ref in refs:
            return refs[ref]
        return ("other", ref)

    def _norm_args(self, a, span, refs):
        return map_nested(a, lambda ref: self._norm_ref(ref, span, refs), Ref)

    # -- replaying ---------------------------------------------------------------------------

    @tp.torch_function_off
    def _replay(self, template: _Span, span: _Span, inputs: list, template_fqn: str, fqn: str):
        rec = self.recorder
        t_refs, t_stores = self._external(template)
        k_ref, k_store = {}, {}
        for key in set(t_refs.values()) | set(t_stores.values()):
            if key.kind == "arg":
                k_ref[key], k_store[key] = span.inputs[key.key].ref, span.inputs[key.key].storage
            else:
                p = tp.local(span.params[key.key])
                k_ref[key], k_store[key] = getattr(p, TAG, None), self.storages.id_of(p)
        offset = len(rec.records) - template.start
        out_leaves, out_store = [], {}
        with rec.suppressed():
            for leaf in template.output:
                if not isinstance(leaf, _Tensor):
                    out_leaves.append(leaf)
                    continue
                if leaf.ref in t_refs:  # the block hands one of its own inputs back
                    key = t_refs[leaf.ref]
                    if key.kind != "arg":
                        raise _Mismatch
                    out_leaves.append(inputs[key.key])
                    continue
                if not leaf.whole or not isinstance(leaf.ref, Ref) or not leaf.ref.is_record:
                    raise _Mismatch  # a view of a larger buffer: not reproducible by a fresh tensor
                new = fresh(self.mode, leaf.shape, leaf.stride, leaf.dtype)
                out_store[leaf.storage] = self.storages.id_of(new)
                setattr(new, TAG, Ref(leaf.ref.source + offset, leaf.ref.index))
                out_leaves.append(new)
        store_map = {sid: k_store[key] for sid, key in t_stores.items()}
        store_map.update(out_store)
        start, end = template.start, template.end

        def ref(r: Ref) -> Ref:
            if r.is_record and start <= r.source < end:
                return Ref(r.source + offset, r.index)
            return k_ref[t_refs[r]] if r in t_refs else r

        modules: dict = {}  # a template module's name -> this block's
        for i in range(start, end):
            r = rec.records[i]
            module = modules.get(r.module)
            if module is None:
                module = modules[r.module] = _renamed(r.module, template_fqn, fqn)
            rec.records.append(OpRecord(
                r.op, map_nested(r.args, ref, Ref), map_nested(r.kwargs, ref, Ref) if r.kwargs else {},
                self._map_val(r.outputs, store_map, template, offset), r.phase, module, NO_NUMBERS,
                r.args_requires_grad, r.scope, r.origin))
            self.storages.clock = len(rec.records) - 1
        self.replayed += 1
        return tp.tree_unflatten(out_leaves, template.output_spec)

    def _map_val(self, val, store_map, template: _Span, offset: int):
        if isinstance(val, tuple):
            return tuple(self._map_val(v, store_map, template, offset) for v in val)
        if not isinstance(val, TensorMeta):
            return val
        sid = store_map.get(val.storage)
        if sid is None and val.storage < template.first_sid:
            sid = val.storage  # a storage from outside every block (a shared table): the same one
        if sid is None:  # a storage born inside the template: a fresh one, same lifetime in the span
            sid = self.storages.synthetic(val.storage_nbytes)
            store_map[val.storage] = sid
            death = self.storages.deaths.get(val.storage)
            if death is not None and template.start <= death < template.end:
                self.storages.deaths[sid] = death + offset
        return TensorMeta(val.shape, val.stride, val.dtype, sid, val.storage_nbytes, val.requires_grad)


class _Mismatch(Exception):
    pass


def _param_meta(params: dict) -> tuple:
    """Each parameter and buffer as the block's forward reads it: under --mesh FSDP2 has just
    gathered them (its mixed-precision policy sets their dtype) and a DTensor's placements decide
    its local ops, so a block replays only where these equal the template's."""
    out = []
    for name, p in params.items():
        t = tp.local(p)
        out.append((name, tuple(t.shape), tuple(t.stride()), t.dtype, p.requires_grad,
                    getattr(p, "placements", None), getattr(p, "device_mesh", None)))
    return tuple(out)


def _has_dtensor(tree) -> bool:
    """Whether a tensor leaf is a DTensor (--mesh: replay is below the DTensor layer)."""
    return any(tp.local(x) is not x for x in tp.tree_leaves(tree) if isinstance(x, torch.Tensor))


def _relative(module: str, fqn: str) -> str:
    return module[len(fqn):] if module == fqn or module.startswith(fqn + ".") else "\0" + module


def _renamed(module: str, template_fqn: str, fqn: str) -> str:
    if module == template_fqn or module.startswith(template_fqn + "."):
        return fqn + module[len(template_fqn):]
    return module
