"""Capture: one aten-level torch.fx graph of forward + loss + autograd backward (+ optimizer step), on fake tensors,
with the lifetime of every storage as the eager run would have it (a capture read for its peak alone keeps its
ops as records instead: CaptureOptions.nodes).

How (DESIGN.md, "Facts verified here"): proxy tracing with make_fx costs 3.5× FlopCounterMode, so fxacct records ops
the way FlopCounterMode sees them, in one TorchDispatchMode stacked on a FakeTensorMode, and builds the fx.Graph
from those records afterwards. The records keep no tensor alive: every storage dies when the traced program drops
its last reference (a local variable going out of scope, autograd releasing what it saved), and a weakref callback
notes after which op. That is exactly when an eager run frees it, so the peak walk (fxacct.memory.peak) sees
Python's own lifetimes, not a guess from the graph.

Each node's meta holds ``val`` (a ``TensorMeta`` per output: shape, stride, dtype, storage id) and ``trace``
(fxacct.trace.graph_builder.NodeTrace): its role, the recorder's phase, the module FQN it ran in (global module
hooks keep the stack; a shared module called twice keeps its one name), for a backward node the forward node it
derives from (a forward op that records an autograd Node takes the next sequence number before it reaches the
dispatch mode; the backward engine runs that Node's ops under the same number), which tensor arguments required
grad, and the (bytes, dtype) autograd saved of the storages it allocated (parameters and buffers excluded).

The user's module is left as it was: parameters are swapped for fake ones only inside ``reparametrize_module``, and
every hook is removed on the way out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxacct.errors import FxacctError, ModelError, UsageError, classify, describe_exception
from fxacct.load.specs import OptimizerSpec
from fxacct.trace import torch_private as tp
from fxacct.trace.checkpointing import checkpointed
from fxacct.trace.compiled import CompileSpec, compiled
from fxacct.trace.dispatch_recorder import BACKWARD, FORWARD, LOSS, OPTIMIZER, AttentionScope, Recorder, module_tracking  # noqa: F401  (re-exported: the phases)
from fxacct.trace.fake_mode import FakeTensorMode
from fxacct.trace.fake_model import FakeModel, PreparedModel, fake_input, swapped
from fxacct.trace.fake_reuse import FakeReuse
from fxacct.trace.graph_builder import BUFFER, INPUT, PARAMETER, GraphBuilder, OpList
from fxacct.trace.hf_eager import hf_eager
from fxacct.trace.loss import LossSpec, returned_loss, target_spec, training_loss
from fxacct.trace.optim_step import step_once
from fxacct.trace.records import TAG, Ref, Slot, StateTensor, Storages, TensorMeta, itemsize, tensor_metas  # noqa: F401  (re-exported)
from fxacct.trace.replay import BlockReplay, find_runs
from fxacct.trace.replay_train import TrainReplay
from fxacct.trace.saved_tensors import SavedTracker
from fxacct.trace.targets import CudaRules


@dataclass(frozen=True)
class CaptureOptions:
    """How to trace. ``dtype``: floating parameters, buffers and inputs cast to it. ``amp``:
    forward and loss under autocast to that dtype. ``master_weights``: the optimizer steps fp32
    copies. ``cuda``: apply fxacct.trace.targets' CUDA kernel rules. ``optimizer``: an
    fxacct.trace.optim_step.OptimizerSpec stepped once after the backward. ``inference``: the
    forward alone, under eval() and no_grad(). ``dedup``: repeated blocks proven identical are
    traced once and replayed (fxacct.trace.replay, fxacct.trace.replay_train)."""

    dtype: torch.dtype | None = None
    input_requires_grad: bool = False
    loss_output: int | None = None
    backward: bool = True
    optimizer: OptimizerSpec | None = None
    inference: bool = False
    amp: torch.dtype | None = None
    master_weights: bool = False
    cuda: bool = False
    dedup: bool = True
    loss: str = "sum"  # fxacct.trace.loss.LOSSES
    causal_lm: bool = False  # cross-entropy targets are the next tokens (fxacct.load.hf.is_causal_lm)
    # the model's own tensors are already fake (fxacct.parallel: a parallelized model materialized
    # under ``prepared``'s FakeTensorMode); its parameters may be DTensors, traced below that layer
    prepared: PreparedModel | None = None
    checkpoint: tuple[str, ...] = ()  # fxacct.trace.checkpointing: module globs to checkpoint
    checkpoint_policy: str | None = None
    defer: tuple = ()  # tensor subclasses whose ops are recorded as they desugar (--fp8: torchao's float8 tensor)
    compile: CompileSpec | None = None  # fxacct.trace.compiled: the step as torch.compile splits it
    nodes: bool = True  # False (a capture read for its peak alone): the ops are kept as Capture.ops, not nodes
    reuse: FakeReuse | None = field(default=None, compare=False)  # fake tensors shared with another capture


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
    # storage id -> index of the last op recorded before the traced program dropped it (none for one alive at the end)
    deaths: dict | None = None
    returned_loss: bool = False  # the output carried a loss of its own (fxacct.trace.loss.returned_loss)
    output_storages: frozenset = frozenset()  # storage ids of the forward's output tensors (training)
    output_metas: tuple = ()  # (local shape, dtype, requires_grad) of the forward's output tensors (training)
    # --compile: (region, forward GraphModule, backward GraphModule) AOTAutograd made per region
    compiled_graphs: tuple = ()
    # --compile: node name -> key of the fused kernel it runs in (fxacct.trace.fusion.FREE: a view),
    # and key -> bytes the kernel moves
    kernel_of: dict | None = None
    kernel_bytes: dict | None = None
    ops: OpList | None = None  # CaptureOptions.nodes False: the ops, where the graph holds the placeholders alone


@dataclass
class _Session:
    """The state of one capture while it runs."""

    options: CaptureOptions
    model: torch.nn.Module
    mode: FakeTensorMode
    storages: Storages
    recorder: Recorder
    builder: GraphBuilder
    fake: FakeModel
    fake_args: tuple
    fake_kwargs: dict
    flat_inputs: list
    input_nodes: list
    saved: SavedTracker
    targets: list = field(default_factory=list)
    grads: tuple = ()
    state_tensors: list = field(default_factory=list)
    masters: list = field(default_factory=list)
    outputs: list = field(default_factory=list)  # inference: the model's outputs, live to the end
    loss: torch.Tensor | None = None
    returned_loss: bool = False
    output_storages: frozenset = frozenset()
    output_metas: tuple = ()
    compiled_graphs: tuple = ()  # --compile: (region, forward GraphModule, backward GraphModule)
    compiled: object = None  # --compile: the CompiledRegions that ran


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, options: CaptureOptions = CaptureOptions()) -> Capture:
    """Trace ``model(*args, **kwargs)``, the loss, its backward and one optimizer step on fake CPU
    tensors. ``args``/``kwargs`` hold example tensors of any device (meta is fine: only shape,
    stride and dtype are read). The user's module is left as it was."""
    session = _start(model, args, kwargs, options)
    try:
        _traced(session)
        return _finish(session)
    finally:
        session.recorder.untag()  # the model may be captured again (fxacct.parallel.profile)


def _traced(session: _Session) -> None:
    """_run, its failures told as fxacct's errors."""
    try:
        _run(session)
    except FxacctError:
        raise
    except (tp.DataDependentOutputException, tp.DynamicOutputShapeException) as e:
        if session.recorder.phase == OPTIMIZER:
            raise UsageError(f"the optimizer's step reads a tensor's value ({describe_exception(e)}), which fake "
                             "tensors do not have: give another --optimizer") from e
        raise ModelError(
            f"the model's {session.recorder.phase} depends on tensor values ({describe_exception(e)}), which "
            "fake tensors do not have; move data-dependent control flow (.item(), if tensor:, nonzero) "
            "out of it or make it shape-only"
        ) from e
    except tp.UnsupportedOperatorException as e:
        raise ModelError(f"an op has no fake-tensor implementation ({e}); fxacct cannot trace it") from e
    except Exception as e:
        if _GROUPED_MM_DTYPE in str(e):  # torch/_meta_registrations.py, _meta_grouped_mm_common
            raise ModelError(
                f"the model's {session.recorder.phase} runs grouped_mm (aten._grouped_mm) in another dtype than "
                "bfloat16, which torch's fake kernel of it refuses: give --dtype bf16, or, for a Hugging Face "
                "MoE model, -k experts_implementation=batched_mm") from e
        raise classify(e, f"the model's {session.recorder.phase}") from e
    finally:
        session.storages.open = False


_GROUPED_MM_DTYPE = "Expected inputs of BF16 type"


def _start(model, args, kwargs, options: CaptureOptions) -> _Session:
    prep = options.prepared
    mode, fake = (prep.mode, prep.fake) if prep is not None else (options.reuse or FakeReuse()).fakes(model, options.dtype)
    storages = Storages()
    recorder = Recorder(storages, (() if prep is None else prep.defer) + options.defer)
    if prep is not None:
        prep.attach(recorder)  # FSDP2's storage resizes noted, its gathers replayed, against the recorded ops
    with mode:
        fake_args = tp.tree_map(lambda t: _to_fake(t, options), args)
        fake_kwargs = tp.tree_map(lambda t: _to_fake(t, options), kwargs)
    flat_inputs = list(_positional_leaves(model, fake_args)) + list(kwargs_leaves(fake_kwargs))
    builder = GraphBuilder()
    input_nodes = _placeholders(builder, recorder, fake, flat_inputs)
    saved = SavedTracker(storages, {storages.id_of(tp.local(t)) for t in fake.fake_of.values()}, recorder)
    return _Session(options, model, mode, storages, recorder, builder, fake, fake_args, fake_kwargs,
                    flat_inputs, input_nodes, saved)


def _to_fake(t, options: CaptureOptions):
    """An example input as a fake tensor; it requires grad under --input-requires-grad, or where
    the example itself does (a pipeline stage's received activation), as eager would."""
    if not isinstance(t, torch.Tensor):
        return t
    f = fake_input(t, options.dtype)
    wanted = options.input_requires_grad or t.requires_grad
    return f.requires_grad_(wanted and f.is_floating_point() and not options.inference)


def _replay_for(session: _Session):
    o = session.options
    runs = o.reuse.runs_of if o.reuse is not None else find_runs
    if o.inference and o.dedup:
        return BlockReplay(session.recorder, session.storages, runs(session.model), session.mode)
    # --checkpoint: no training replay. A replayed block stands in for a run of the module the checkpoint wrapper
    # surrounds: torch.utils.checkpoint's frame would see one traced block's saved tensors against a recompute of
    # each (CheckpointError). --compile: a compiled region runs its graphs: no submodule calls to replay
    if o.dedup and o.backward and not o.checkpoint and o.compile is None:
        return TrainReplay(session.recorder, session.storages, runs(session.model), session.mode, session.saved)
    return contextlib.nullcontext()


def _run(session: _Session) -> None:
    """The traced program: forward, then (training) loss, backward and one optimizer step."""
    o, rec, model = session.options, session.recorder, session.model
    names = {id(m): n for n, m in model.named_modules()}
    replay = _replay_for(session)
    with _QuietFakeTensorLog(), session.mode, rec, module_tracking(rec, names), \
            swapped(model, session.fake, training=not o.inference), \
            torch.autograd.graph.saved_tensors_hooks(session.saved.pack, session.saved.unpack), \
            AttentionScope(rec), (CudaRules() if o.cuda else contextlib.nullcontext()), replay, \
            checkpointed(model, o.checkpoint, o.checkpoint_policy), compiled(model, o.compile, rec) as regions:
        with torch.no_grad() if o.inference else contextlib.nullcontext(), _autocast(o), hf_eager(model):
            box = [model(*session.fake_args, **session.fake_kwargs)]  # _train_step drops it
        if o.inference:
            session.outputs = [t for t in tp.tree_leaves(box.pop()) if isinstance(t, torch.Tensor)]
        else:
            _train_step(session, box)
        session.storages.open = False  # what is still alive now lives to the end of the step
    if hasattr(replay, "finish"):
        replay.finish()
    if regions is not None:
        session.compiled_graphs, session.compiled = tuple(regions.graphs), regions


def _autocast(o: CaptureOptions):
    return torch.autocast("cpu", dtype=o.amp) if o.amp is not None else contextlib.nullcontext()


def _train_step(session: _Session, box: list) -> None:
    """Loss, backward and optimizer step; ``box`` holds the forward's output, the only reference."""
    o, rec = session.options, session.recorder
    rec.phase = LOSS
    output = box.pop()
    leaves = [t for t in tp.tree_leaves(output) if isinstance(t, torch.Tensor)]
    session.output_storages = frozenset(session.storages.id_of(tp.local(t)) for t in leaves)
    session.output_metas = tuple((tuple(tp.local(t).shape), t.dtype, t.requires_grad) for t in leaves)
    del leaves  # (the outputs live only as long as the loss needs them, below)
    spec = LossSpec(o.loss, o.loss_output, o.causal_lm)
    session.returned_loss = returned_loss(output)
    target = _target(session, target_spec(output, spec))
    with _autocast(o):
        session.loss = loss = training_loss(output, spec, target)  # alive to the step's end
    del output  # `loss = model(x).sum()`: the outputs live only as long as the loss needs them
    session.targets = targets = session.fake.trainable()
    targets += [t for _, t in session.flat_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not (o.backward and loss.requires_grad and targets):
        return
    seed = torch.ones_like(loss)
    rec.phase = BACKWARD
    # loss.backward() as a training loop calls it: each leaf's AccumulateGrad runs (FSDP2 reduce-scatters
    # into .grad of the parameters it swapped out), and reentrant checkpointing, which refuses
    # torch.autograd.grad (torch.autograd._is_checkpoint_valid), works
    loss.backward(seed)
    session.grads = tuple(t.grad for t in targets)
    del seed
    if o.optimizer is not None:
        rec.phase = OPTIMIZER
        session.state_tensors, session.masters = step_once(
            o.optimizer, session.fake.param_groups, session.fake.fake_of, targets, session.grads,
            o.master_weights, rec)


def _target(session: _Session, spec):
    """The loss's target, an input of the step (a placeholder, resident like the model's inputs,
    phase loss): made outside the recorded ops, as a data loader makes it before the step."""
    if spec is None:
        return None
    with session.recorder.suppressed():
        t = torch.empty(spec.shape, dtype=spec.dtype)
    slot = Slot("input", "target")
    node = session.builder.placeholder(slot, "target", session.recorder.meta(t), INPUT)
    node.meta["trace"] = dataclasses.replace(node.meta["trace"], phase=LOSS)
    session.recorder.tag(t, Ref(slot))
    session.flat_inputs.append(("target", t))  # held to the step's end, as the loop's variable
    return t


def _placeholders(builder: GraphBuilder, recorder: Recorder, fake: FakeModel, flat_inputs) -> list[fx.Node]:
    """One placeholder per input tensor, parameter and buffer, each tensor tagged with it."""
    input_nodes = []
    for name, t in flat_inputs:
        if isinstance(t, torch.Tensor):
            slot = Slot("input", len(input_nodes))
            input_nodes.append(builder.placeholder(slot, name, recorder.meta(t), INPUT))
            recorder.tag(t, Ref(slot))
    for kind, role, groups in (("param", PARAMETER, fake.param_groups), ("buffer", BUFFER, fake.buffer_groups)):
        for tid, group in groups.items():
            slot = Slot(kind, tid)
            t = tp.local(fake.fake_of[tid])  # a DTensor's shard on this rank
            builder.placeholder(slot, group[0].replace(".", "_"), recorder.meta(t), role, group[0])
            recorder.tag(t, Ref(slot))
    return input_nodes


def _finish(session: _Session) -> Capture:
    builder, rec, storages, fake = session.builder, session.recorder, session.storages, session.fake
    grads = tuple(None if g is None else tp.local(g) for g in session.grads)
    ops = None if session.options.nodes or session.compiled else builder.op_list(rec.records, rec.constants)
    if ops is None:
        builder.add_records(rec.records, rec.constants, rec.repeat_of, session.saved.saved)
        out_refs = [getattr(g, TAG) for g in grads if g is not None] + [getattr(t, TAG) for t in session.outputs]
        builder.graph.output(tuple(builder.lookup(r) for r in out_refs))
    got_grad = {id(t): g is not None for t, g in zip(session.targets, grads)}

    def info(tid: int, group: list[str], trainable: bool) -> ParamInfo:
        d = fake.fake_of[tid]
        t = tp.local(d)  # a DTensor's shard on this rank
        return ParamInfo(tuple(group), tuple(t.shape), t.dtype, trainable and d.requires_grad,
                         trainable and got_grad.get(id(d), False))

    opt_state: dict[int, StateTensor] = {}
    for t, count in session.state_tensors:
        t = tp.local(t)
        sid = storages.id_of(t)
        opt_state.setdefault(sid, StateTensor(t.dtype, t.untyped_storage().nbytes(), sid, t.dim() == 0, count))
    return Capture(
        graph=builder.graph,
        params=tuple(info(pid, group, True) for pid, group in fake.param_groups.items()),
        buffers=tuple(info(bid, group, False) for bid, group in fake.buffer_groups.items()),
        input_nodes=tuple(session.input_nodes), has_backward=bool(grads),
        module_names=tuple(n for n, _ in session.model.named_modules()),
        optimizer_state=tuple(opt_state.values()),
        grad_storages=frozenset(storages.id_of(g) for g in grads if g is not None),
        saved_storages=frozenset(session.saved.saved),
        master_weights=tuple((storages.id_of(m), m.untyped_storage().nbytes(), c) for m, c in session.masters),
        inference=session.options.inference, deaths=dict(storages.deaths),
        returned_loss=session.returned_loss, output_storages=session.output_storages,
        compiled_graphs=session.compiled_graphs, ops=ops, output_metas=session.output_metas,
        **(session.compiled.by_node(builder.nodes) if session.compiled is not None else {}),
    )



def _positional_leaves(model, args):
    """(name, tensor) for positional inputs, named after forward's parameters where it has them."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    for i, a in enumerate(args):
        base = params[i] if i < len(params) else f"input_{i}"
        leaves = tp.tree_leaves(a)
        for j, t in enumerate(leaves):
            yield (base if len(leaves) == 1 else f"{base}_{j}"), t


def kwargs_leaves(kwargs: dict):
    for k, v in kwargs.items():
        leaves = tp.tree_leaves(v)
        for i, t in enumerate(leaves):
            yield (k if len(leaves) == 1 else f"{k}_{i}"), t


class _QuietFakeTensorLog:
    """FakeTensorMode logs a full traceback before re-raising a kernel's error; fxacct reports the
    error itself in one line (--debug shows the traceback), so its log is muted while tracing."""

    def __enter__(self):
        self.logger = logging.getLogger(tp.FAKE_TENSOR_LOGGER)
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
