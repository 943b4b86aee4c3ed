"""Capture: one aten-level torch.fx graph of forward + loss + autograd backward (+ optimizer
step), on fake tensors, with the lifetime of every storage as the eager run would have it.

How (DESIGN.md, "Facts verified here"): proxy tracing with make_fx costs 3.5× FlopCounterMode, so
fxacct records ops the way FlopCounterMode sees them, in one TorchDispatchMode stacked on a
FakeTensorMode, and builds the fx.Graph from those records afterwards. The records keep no
tensor alive: every storage dies when the traced program drops its last reference (a local
variable going out of scope, autograd releasing what it saved), and a weakref callback notes
after which op. That is exactly when an eager run frees it, so the peak walk (fxacct.memory.peak)
sees Python's own lifetimes, not a guess from the graph.

Each node's meta holds:
- ``val``: a ``TensorMeta`` (shape, stride, dtype, storage id) per output, a tuple for
  multi-output ops (None where an output is not a tensor);
- ``phase``: forward / loss / backward / optimizer;
- ``module``: the FQN from ``named_modules()`` of the module it ran in (global module hooks keep
  the stack; a shared module called twice keeps its one name);
- ``fwd``: for a backward node, the forward node it derives from. A forward op that records an
  autograd Node takes the next sequence number before it reaches the dispatch mode; the backward
  engine runs that Node's ops with ``_current_autograd_node()`` set to it (same number);
- ``args_requires_grad``: for each tensor argument, whether it required grad (fused backward
  kernels are costed for the gradients actually needed);
- ``saved``: on the node that allocated a storage, (bytes, dtype) of that storage if autograd
  saved it for backward (``saved_tensors_hooks``); parameters and buffers excluded.

The user's module is left as it was: parameters are swapped for fake ones only inside
``reparametrize_module``, and every hook is removed on the way out.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxacct.trace import torch_private as tp
from fxacct.errors import FxacctError, ModelError, classify, describe_exception
from fxacct.trace.loss import training_loss
from fxacct.trace.optim_step import step_once
from fxacct.trace.dispatch_recorder import (  # noqa: F401  (re-exported: the phases and the recorder)
    BACKWARD, FORWARD, LOSS, OPTIMIZER, AttentionScope, Recorder, SavedTracker, module_tracking,
)
from fxacct.trace.records import (  # noqa: F401  (re-exported)
    TAG, Ref, StateTensor, Storages, TensorMeta, itemsize, tensor_metas,
)

_Recorder, _Storages, Ref, TAG = Recorder, Storages, Ref, TAG  # the names replay code used

@dataclass(frozen=True)
class ParamInfo:
    """One parameter storage (tied names share one entry)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    got_grad: bool  # the traced backward produced a gradient for it


@dataclass(frozen=True)
class Capture:
    graph: fx.Graph
    params: tuple[ParamInfo, ...]
    buffers: tuple[ParamInfo, ...]
    input_nodes: tuple[fx.Node, ...]
    has_backward: bool
    module_names: tuple[str, ...]  # named_modules() order
    optimizer_state: tuple[StateTensor, ...] = ()  # per unique storage, after one step
    grad_storages: frozenset = frozenset()  # storage ids of the parameter gradients
    saved_storages: frozenset = frozenset()  # storage ids autograd saved for backward
    master_weights: tuple[tuple[int, int, int], ...] = ()  # (storage id, bytes, count) of fp32 master copies
    inference: bool = False  # forward only, under eval() and no_grad()
    # storage id -> index of the last op recorded before the traced program dropped it; storages
    # alive when the step ends are absent
    deaths: dict | None = None


def _op_name(func) -> str:
    return getattr(func, "_opname", None) or getattr(func, "__name__", "op")


class _GraphBuilder:
    """Turns the records into an fx.Graph, resolving each argument reference to its node."""

    def __init__(self):
        self.graph = fx.Graph()
        self.nodes: dict[object, fx.Node] = {}  # record index or placeholder key -> node
        self.getitems: dict[tuple, fx.Node] = {}

    def placeholder(self, key, name: str, val: TensorMeta, **meta) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta.update(val=val, phase=FORWARD, module="", **meta)
        self.nodes[key] = node
        return node

    def lookup(self, ref: Ref) -> fx.Node:
        parent = self.nodes[ref.source]
        if ref.index is None:
            return parent
        node = self.getitems.get(ref)
        if node is None:
            node = self.graph.create_node("call_function", operator.getitem, (parent, ref.index))
            node.meta.update(val=parent.meta["val"][ref.index], phase=parent.meta["phase"],
                             module=parent.meta["module"])
            if "fwd" in parent.meta:
                node.meta["fwd"] = parent.meta["fwd"]
            self.getitems[ref] = node
        return node

    def map_arg(self, a):
        if isinstance(a, Ref):
            return self.lookup(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self.map_arg(x) for x in a)
        return a

    def add(self, index: int, func, args, kwargs, val, phase, module, rg) -> fx.Node:
        node = tp.fx_append_node(self.graph, "call_function", func, self.map_arg(args),
                                 {k: self.map_arg(v) for k, v in kwargs.items()}, _op_name(func))
        node.meta.update(val=val, phase=phase, module=module, args_requires_grad=rg)
        self.nodes[index] = node
        return node


def _fake_like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A fake CPU tensor with t's shape and strides (call inside the FakeTensorMode)."""
    if dtype is not None and t.is_floating_point():
        return torch.empty(t.shape, dtype=dtype, device="cpu")
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


@dataclass
class _FakeModel:
    """The fake stand-ins of a module's tensors for one capture (tied names share one tensor)."""

    fake_of: dict  # id(real tensor) -> fake tensor
    state: dict  # every parameter and buffer name -> its fake tensor (for reparametrize_module)
    param_groups: dict  # id(parameter) -> its names
    buffer_groups: dict  # id(buffer) -> its names
    attributes: list  # (module, name, real, fake) of tensors kept as plain attributes

    def trainable(self) -> list[torch.Tensor]:
        return [self.fake_of[pid] for pid in self.param_groups if self.fake_of[pid].requires_grad]


def _fake_model(model: torch.nn.Module, dtype: torch.dtype | None, inference: bool) -> _FakeModel:
    """Call inside the FakeTensorMode."""
    fake = _FakeModel({}, {}, {}, {}, [])
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in fake.fake_of:
            fake.fake_of[id(p)] = _fake_like(p, dtype).requires_grad_(p.requires_grad and not inference)
        fake.param_groups.setdefault(id(p), []).append(name)
        fake.state[name] = fake.fake_of[id(p)]
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in fake.fake_of:
            fake.fake_of[id(b)] = _fake_like(b, dtype)
        fake.buffer_groups.setdefault(id(b), []).append(name)
        fake.state[name] = fake.fake_of[id(b)]
    # tensors a module keeps as plain attributes (not parameters or buffers): swapped too
    fake.attributes = [(m, k, v, _fake_like(v, dtype)) for m in model.modules() for k, v in vars(m).items()
                       if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
    return fake


def _placeholders(builder: _GraphBuilder, recorder: Recorder, fake: _FakeModel, flat_inputs) -> list[fx.Node]:
    """One placeholder per input tensor, parameter and buffer, each tensor tagged with it."""
    input_nodes = []
    for name, t in flat_inputs:
        if isinstance(t, torch.Tensor):
            key = ("input", len(input_nodes))
            input_nodes.append(builder.placeholder(key, name, recorder.meta(t), kind="input"))
            setattr(t, TAG, Ref(key, None))
    for kind, groups in (("param", fake.param_groups), ("buffer", fake.buffer_groups)):
        for tid, group in groups.items():
            key = (kind, tid)
            builder.placeholder(key, group[0].replace(".", "_"), recorder.meta(fake.fake_of[tid]), **{kind: group[0]})
            setattr(fake.fake_of[tid], TAG, Ref(key, None))
    return input_nodes


def _add_records(builder: _GraphBuilder, recorder: Recorder) -> None:
    """Every record becomes a node; a backward node points at its forward node (meta["fwd"])."""
    for key, meta in recorder.constants:
        builder.placeholder(key, "constant", meta, constant=True)
    seq_owner: dict[int, fx.Node] = {}
    for index, (func, a, kw, val, phase, module, link, rg, scope) in enumerate(recorder.records):
        if phase == BACKWARD:
            if isinstance(link, tuple):  # ("rec", index): a replayed block's (fxacct.trace.replay_train)
                fwd = builder.nodes[link[1]]
            else:
                fwd = seq_owner.get(link) if link is not None else None
            node = builder.add(index, func, a, kw, val, BACKWARD, fwd.meta["module"] if fwd is not None else "", rg)
            node.meta["fwd"] = fwd
            if fwd is not None and fwd.meta["phase"] == LOSS:
                node.meta["phase"] = LOSS
        else:
            node = builder.add(index, func, a, kw, val, phase, module, rg)
            for s in link:
                seq_owner[s] = node
            if phase == OPTIMIZER:
                node.meta["repeat"] = recorder.repeat_of(index)
        if scope is not None:
            node.meta["scope"] = scope


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, *, dtype: torch.dtype | None = None,
            input_requires_grad: bool = False, loss_output: int | None = None,
            backward: bool = True, optimizer=None, inference: bool = False,
            amp: torch.dtype | None = None, master_weights: bool = False, cuda: bool = False,
            dedup: bool = True) -> Capture:
    """Trace ``model(*args, **kwargs)``, the loss, its backward and one optimizer step on fake
    CPU tensors.

    ``args``/``kwargs`` hold example tensors of any device (meta is fine: only shape, stride and
    dtype are read). With ``dtype``, floating parameters, buffers and inputs are cast to it.
    ``amp``: forward and loss under autocast to that dtype. ``master_weights``: the optimizer
    steps fp32 copies of the parameters. ``cuda``: apply fxacct.predict.targets' CUDA kernel rules.
    ``optimizer``: an fxacct.trace.optim_step.OptimizerSpec stepped once after the backward.
    ``inference``: the forward alone, under eval() and no_grad(). ``dedup``: repeated blocks
    proven identical are traced once and replayed (fxacct.trace.replay, fxacct.trace.replay_train).
    """
    from fxacct.trace.replay import BlockReplay, find_runs
    from fxacct.trace.replay_train import TrainReplay
    from fxacct.predict.targets import CudaRules

    def autocast():
        return torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()

    def to_fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        f = _fake_like(t, dtype)
        return f.requires_grad_(input_requires_grad and f.is_floating_point() and not inference)

    names = {id(m): n for n, m in model.named_modules()}
    was_training = {m: m.training for m in model.modules()}
    mode = tp.FakeTensorMode(allow_non_fake_inputs=True)  # a stray CPU tensor becomes a fake one
    storages = Storages()
    recorder = Recorder(storages)
    builder = _GraphBuilder()
    with mode:
        fake = _fake_model(model, dtype, inference)
        fake_args = torch.utils._pytree.tree_map(to_fake, args)
        fake_kwargs = torch.utils._pytree.tree_map(to_fake, kwargs)
    flat_inputs = list(_positional_leaves(model, fake_args)) + list(kwargs_leaves(fake_kwargs))
    input_nodes = _placeholders(builder, recorder, fake, flat_inputs)
    saved = SavedTracker(storages, {storages.id_of(t) for t in fake.fake_of.values()})
    if inference and dedup:
        replay = BlockReplay(recorder, storages, find_runs(model))
    elif dedup and backward:
        replay = TrainReplay(recorder, storages, find_runs(model), saved)
    else:
        replay = contextlib.nullcontext()

    grads: tuple = ()
    targets: list[torch.Tensor] = []
    state_tensors: list = []
    masters: list = []
    outputs: list[torch.Tensor] = []  # inference: the model's outputs, live to the end
    try:
        model.train(not inference)
        for m, k, _, fake_tensor in fake.attributes:
            setattr(m, k, fake_tensor)
        with _QuietFakeTensorLog(), mode, recorder, module_tracking(recorder, names), \
                tp.reparametrize_module(model, fake.state, strict=False), \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), \
                AttentionScope(recorder), (CudaRules() if cuda else contextlib.nullcontext()), replay:
            with torch.no_grad() if inference else contextlib.nullcontext(), autocast():
                output = model(*fake_args, **fake_kwargs)
            if inference:
                outputs = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
            else:
                recorder.phase = LOSS
                with autocast():
                    loss = training_loss(output, loss_output)
                del output  # `loss = model(x).sum()`: the outputs live only as the loss needs them
                targets = fake.trainable()
                if input_requires_grad:
                    targets += [t for _, t in flat_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                if backward and loss.requires_grad and targets:
                    seed = torch.ones_like(loss)
                    recorder.phase = BACKWARD
                    grads = torch.autograd.grad(loss, targets, grad_outputs=seed, allow_unused=True)
                    del seed
                    if optimizer is not None:
                        recorder.phase = OPTIMIZER
                        state_tensors, masters = step_once(optimizer, fake.param_groups, fake.fake_of,
                                                                 targets, grads, master_weights, recorder)
            storages.open = False  # what is still alive now lives to the end of the step
        if isinstance(replay, TrainReplay):
            replay.finish()
    except FxacctError:
        raise
    except (tp.DataDependentOutputException, tp.DynamicOutputShapeException) as e:
        raise ModelError(
            f"the model's forward depends on tensor values ({describe_exception(e)}), which "
            "fake tensors do not have; move data-dependent control flow (.item(), if tensor:, nonzero) "
            "out of forward or make it shape-only"
        ) from e
    except tp.UnsupportedOperatorException as e:
        raise ModelError(f"an op has no fake-tensor implementation ({e}); fxacct cannot trace it") from e
    except Exception as e:
        raise classify(e, f"the model's {recorder.phase}") from e
    finally:
        storages.open = False
        for m, flag in was_training.items():
            m.training = flag
        for m, k, original, _ in fake.attributes:
            setattr(m, k, original)

    _add_records(builder, recorder)
    _attach_saved(builder.graph, saved.saved)
    out_refs = [getattr(g, TAG) for g in grads if g is not None] + [getattr(t, TAG) for t in outputs]
    builder.graph.output(tuple(builder.lookup(r) for r in out_refs))

    got_grad = {id(t): g is not None for t, g in zip(targets, grads)}

    def info(tid: int, group: list[str], trainable: bool) -> ParamInfo:
        t = fake.fake_of[tid]
        return ParamInfo(tuple(group), tuple(t.shape), t.dtype, trainable and t.requires_grad,
                         trainable and got_grad.get(id(t), False))

    opt_state: dict[int, StateTensor] = {}
    for t, count in state_tensors:
        sid = storages.id_of(t)
        opt_state.setdefault(sid, StateTensor(t.dtype, t.untyped_storage().nbytes(), sid, t.dim() == 0, count))
    return Capture(
        graph=builder.graph,
        params=tuple(info(pid, group, True) for pid, group in fake.param_groups.items()),
        buffers=tuple(info(bid, group, False) for bid, group in fake.buffer_groups.items()),
        input_nodes=tuple(input_nodes), has_backward=bool(grads), module_names=tuple(names.values()),
        optimizer_state=tuple(opt_state.values()),
        grad_storages=frozenset(storages.id_of(g) for g in grads if g is not None),
        saved_storages=frozenset(saved.saved),
        master_weights=tuple((storages.id_of(m), m.untyped_storage().nbytes(), c) for m, c in masters),
        inference=inference, deaths=dict(storages.deaths),
    )


def _attach_saved(graph: fx.Graph, saved: dict[int, tuple[int, torch.dtype]]) -> None:
    """Put each saved storage's (bytes, dtype) on the node that allocated it (its first producer)."""
    remaining = dict(saved)
    for node in graph.nodes:
        if not remaining:
            return
        if node.target is operator.getitem:
            continue
        val = node.meta.get("val")
        for v in (val if isinstance(val, tuple) else (val,)):
            if isinstance(v, TensorMeta) and v.storage in remaining:
                node.meta.setdefault("saved", []).append(remaining.pop(v.storage))


def _positional_leaves(model, args):
    """(name, tensor) for positional inputs, named after forward's parameters where it has them."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    for i, a in enumerate(args):
        base = params[i] if i < len(params) else f"input_{i}"
        leaves = torch.utils._pytree.tree_leaves(a)
        for j, t in enumerate(leaves):
            yield (base if len(leaves) == 1 else f"{base}_{j}"), t


def kwargs_leaves(kwargs: dict):
    for k, v in kwargs.items():
        leaves = torch.utils._pytree.tree_leaves(v)
        for i, t in enumerate(leaves):
            yield (k if len(leaves) == 1 else f"{k}_{i}"), t


class _QuietFakeTensorLog:
    """FakeTensorMode logs a full traceback before re-raising a kernel's error; fxacct reports the
    error itself in one line (--debug shows the traceback), so its log is muted while tracing."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("torch._subclasses.fake_tensor")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


