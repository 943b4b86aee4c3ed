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
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from fxacct import _torch_private as tp
from fxacct.errors import USER_FRAMES_HINT, ModelError, UsageError, describe_exception

FORWARD, LOSS, BACKWARD, OPTIMIZER = "forward", "loss", "backward", "optimizer"
_PRIM_DEVICE = torch.ops.prim.device.default
# metadata queries (prim.device, ...) and profiler markers (record_function): no tensor work
_NOT_RECORDED = frozenset({"prim", "profiler"})
_TAG = "_fxacct_ref"  # attribute set on each traced tensor: which record (or placeholder) made it


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What fxacct keeps of a tensor: enough for costs and bytes, holding no memory."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    storage: int  # storage id, unique within one capture; views share their base's
    storage_nbytes: int
    requires_grad: bool = False

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel() * _itemsize(self.dtype)


def tensor_metas(val) -> tuple[TensorMeta, ...]:
    """The TensorMetas of a node's val: one for a tensor, the tensors of a multi-output op."""
    if isinstance(val, TensorMeta):
        return (val,)
    if isinstance(val, (tuple, list)):
        return tuple(v for v in val if isinstance(v, TensorMeta))
    return ()


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype, device="meta").element_size()
    return size


class StateTensor(NamedTuple):
    """One storage of optimizer state after a step."""

    dtype: torch.dtype
    nbytes: int
    key: int  # storage id
    scalar: bool  # a 0-dim tensor (a step count), not a per-parameter buffer
    count: int = 1  # parameters of this shape the representative stands for


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


class _Storages:
    """Storage ids that stay unique for the whole capture, and when each storage died."""

    def __init__(self):
        self.ids: dict[int, int] = {}  # live storage _cdata -> id
        self.nbytes: dict[int, int] = {}  # id -> bytes
        self.deaths: dict[int, int] = {}
        self.clock = -1  # index of the last recorded op
        self.open = True
        # id -> (dtype, bytes) where the real kernel's output differs from the fake kernel's
        self.real: dict[int, tuple[torch.dtype, int]] = {}
        self.pinned: set[int] = set()  # deaths set by fxacct.replay_train, not by the callback

    @property
    def next_id(self) -> int:
        return len(self.nbytes)

    def synthetic(self, nbytes: int) -> int:
        """An id for a storage that a replayed block (fxacct.replay) would have allocated."""
        sid = len(self.nbytes)
        self.nbytes[sid] = nbytes
        return sid

    def id_of(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        cdata = st._cdata
        sid = self.ids.get(cdata)
        if sid is None:
            sid = len(self.nbytes)
            self.ids[cdata] = sid
            self.nbytes[sid] = st.nbytes()
            weakref.finalize(st, self._died, cdata, sid)
        return sid

    def _died(self, cdata: int, sid: int) -> None:
        if self.ids.get(cdata) == sid:
            del self.ids[cdata]
        if self.open and sid not in self.pinned:
            self.deaths[sid] = self.clock


def _batch_norm_stats(storages: _Storages, args, out) -> None:
    """Batch norm's saved mean and inverse std take the dtype of its weight / running stats when
    those differ from the input's (a bf16 input with fp32 parameters under autocast): the CPU and
    CUDA kernels compute them in the parameter type (aten/src/ATen/native/Normalization.cpp,
    `mixed_type`), the fake kernel in the input's."""
    x = args[0]
    params = [a for a in args[1:5] if isinstance(a, torch.Tensor)]
    if not params or params[0].dtype == x.dtype:
        return
    dtype = params[0].dtype
    for t in out[1:3]:
        if isinstance(t, torch.Tensor) and t.dtype != dtype:
            storages.real[storages.id_of(t)] = (dtype, t.numel() * _itemsize(dtype))


_aten = torch.ops.aten
_KERNEL_DTYPES = {
    op: _batch_norm_stats for op in (
        _aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
        _aten._native_batch_norm_legit.no_stats, _aten._native_batch_norm_legit_no_training.default,
        _aten._native_batch_norm_legit_functional.default,
    )
}


class _Ref(NamedTuple):
    """A tensor argument in a record: the record (or placeholder) that produced it."""

    source: object  # int record index, or a placeholder key
    index: int | None  # output position of a multi-output op


class _Recorder(TorchDispatchMode):
    """Records every aten op with its phase, module, autograd sequence link, argument references
    and output metadata. Per op it does only that; the graph is built once afterwards."""

    def __init__(self, storages: _Storages):
        super().__init__()
        self.records: list[tuple] = []
        self.constants: list[tuple] = []  # (key, TensorMeta) of tensors no traced op produced
        self.phase = FORWARD
        self.module_stack: list[str] = [""]
        self.last_seq = tp.get_sequence_nr()
        self.storages = storages
        self.repeats: list[tuple[int, int, int]] = []  # (first record, end, parameters it stands for)
        self.recording = True

    @contextlib.contextmanager
    def suppressed(self):
        """Ops run but are not recorded (fxacct.replay makes a replayed block's outputs)."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def repeat_of(self, index: int) -> int:
        for start, end, count in self.repeats:
            if start <= index < end:
                return count
        return 1

    def meta(self, t: torch.Tensor) -> TensorMeta:
        sid = self.storages.id_of(t)
        dtype, nbytes = self.storages.real.get(sid, (t.dtype, t.untyped_storage().nbytes()))
        return TensorMeta(tuple(t.shape), tuple(t.stride()), dtype, sid, nbytes, t.requires_grad)

    def ref(self, t: torch.Tensor) -> _Ref:
        ref = getattr(t, _TAG, None)
        if ref is None:  # made outside the traced ops: a constant held by the module or the code
            ref = _Ref(("constant", len(self.constants)), None)
            self.constants.append((ref.source, self.meta(t)))
            setattr(t, _TAG, ref)
        return ref

    def refs(self, a, rg: list):
        if isinstance(a, torch.Tensor):
            rg.append(a.requires_grad)
            return self.ref(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self.refs(x, rg) for x in a)
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and isinstance(args[0], tp.FakeTensor):
            # the backward engine asks every gradient for its device; answer as FakeTensor
            # would (its fake_device) without a trip through the fake mode's dispatch
            return args[0].fake_device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _NOT_RECORDED or not self.recording:
            return out
        fix = _KERNEL_DTYPES.get(func)
        if fix is not None:
            fix(self.storages, args, out)
        index = len(self.records)
        rg: list[bool] = []
        ref_args = self.refs(args, rg)
        ref_kwargs = {k: self.refs(v, rg) for k, v in kwargs.items()}
        if isinstance(out, torch.Tensor):
            val = self.meta(out)
            setattr(out, _TAG, _Ref(index, None))
        elif isinstance(out, (tuple, list)):
            val = []
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    val.append(self.meta(o))
                    setattr(o, _TAG, _Ref(index, i))
                else:
                    val.append(None)
            val = tuple(val)
        else:
            val = None
        if self.phase == BACKWARD:
            node = tp.current_autograd_node()
            link = node._sequence_nr() if node is not None else None
            self.records.append((func, ref_args, ref_kwargs, val, BACKWARD, None, link, tuple(rg)))
        else:
            hi = tp.get_sequence_nr()
            seqs = range(self.last_seq, hi)
            self.last_seq = hi
            self.records.append((func, ref_args, ref_kwargs, val, self.phase, self.module_stack[-1], seqs,
                                 tuple(rg)))
        self.storages.clock = index
        return out


@contextlib.contextmanager
def _module_tracking(recorder: _Recorder, names: dict[int, str]):
    """Global forward pre/post hooks that keep the FQN of the running module on a stack."""

    def pre(module, args):
        name = names.get(id(module))
        recorder.module_stack.append(recorder.module_stack[-1] if name is None else name)

    def post(module, args, output):
        recorder.module_stack.pop()

    h_pre = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h_post = torch.nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        yield
    finally:
        h_pre.remove()
        h_post.remove()


class _SavedTracker:
    """Pack hook of ``saved_tensors_hooks``: which storages autograd saves (ids, each once).
    It keeps the tensor itself, so what autograd keeps alive is what it would keep anyway, and
    its version: with a hook installed autograd skips its own check that a saved tensor was not
    modified in place, so unpack makes it, with autograd's message."""

    def __init__(self, storages: _Storages, excluded: set[int]):
        self.storages = storages
        self.excluded = excluded
        self.saved: dict[int, tuple[int, torch.dtype]] = {}  # id -> (bytes, dtype)

    def pack(self, t: torch.Tensor):
        sid = self.storages.id_of(t)
        if sid not in self.excluded and sid not in self.saved:
            dtype, nbytes = self.storages.real.get(sid, (t.dtype, t.untyped_storage().nbytes()))
            self.saved[sid] = (nbytes, dtype)
        return t, t._version

    @staticmethod
    def unpack(packed):
        t, version = packed
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a {t.dtype} tensor of shape {tuple(t.shape)} is at version {t._version}; "
                f"expected version {version}")
        return t


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

    def lookup(self, ref: _Ref) -> fx.Node:
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
        if isinstance(a, _Ref):
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


def _loss_of(output, loss_output: int | None) -> torch.Tensor:
    """DESIGN.md: the sum over every floating-point output tensor (pytree order) of t.float().sum(),
    or only the output at index ``loss_output`` of that list."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if loss_output is not None:
        if not 0 <= loss_output < len(leaves):
            raise UsageError(
                f"--loss-output {loss_output} is out of range: the model returns {len(leaves)} "
                f"floating-point tensor(s); pick an index from 0 to {len(leaves) - 1}"
            )
        leaves = [leaves[loss_output]]
    if not leaves:
        raise ModelError("the model returned no floating-point tensor to build a loss from; "
                         "return the logits or the loss from forward")
    loss = leaves[0].float().sum()
    for t in leaves[1:]:
        loss = loss + t.float().sum()
    return loss


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
    steps fp32 copies of the parameters. ``cuda``: apply fxacct.targets' CUDA kernel rules.
    ``optimizer``: an fxacct.optim.OptimizerSpec stepped once after the backward.
    ``inference``: the forward alone, under eval() and no_grad(); with ``dedup``, repeated
    blocks proven identical are traced once and replayed (fxacct.replay).
    """
    from fxacct.replay import BlockReplay, find_runs
    from fxacct.replay_train import TrainReplay

    from fxacct.targets import CudaRules

    def autocast():
        return torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()

    names = {id(m): n for n, m in model.named_modules()}
    was_training = {m: m.training for m in model.modules()}
    mode = tp.FakeTensorMode(allow_non_fake_inputs=True)  # a stray CPU tensor becomes a fake one
    storages = _Storages()
    quiet = _QuietFakeTensorLog()
    recorder = _Recorder(storages)
    builder = _GraphBuilder()
    with mode:
        fake_of: dict[int, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        param_groups: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in fake_of:
                fake_of[id(p)] = _fake_like(p, dtype).requires_grad_(p.requires_grad and not inference)
            param_groups.setdefault(id(p), []).append(name)
            state[name] = fake_of[id(p)]
        buffer_groups: dict[int, list[str]] = {}
        for name, b in model.named_buffers(remove_duplicate=False):
            if id(b) not in fake_of:
                fake_of[id(b)] = _fake_like(b, dtype)
            buffer_groups.setdefault(id(b), []).append(name)
            state[name] = fake_of[id(b)]

        def to_fake(t):
            if not isinstance(t, torch.Tensor):
                return t
            f = _fake_like(t, dtype)
            return f.requires_grad_(input_requires_grad and f.is_floating_point() and not inference)

        fake_args = torch.utils._pytree.tree_map(to_fake, args)
        fake_kwargs = torch.utils._pytree.tree_map(to_fake, kwargs)
        # tensors a module keeps as plain attributes (not parameters or buffers): swapped too
        attributes = [(m, k, v, _fake_like(v, dtype)) for m in model.modules() for k, v in vars(m).items()
                      if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]

    flat_inputs = list(_positional_leaves(model, fake_args)) + list(kwargs_leaves(fake_kwargs))
    input_nodes = []
    for name, t in flat_inputs:
        if isinstance(t, torch.Tensor):
            key = ("input", len(input_nodes))
            input_nodes.append(builder.placeholder(key, name, recorder.meta(t), kind="input"))
            setattr(t, _TAG, _Ref(key, None))
    for pid, group in param_groups.items():
        key = ("param", pid)
        builder.placeholder(key, group[0].replace(".", "_"), recorder.meta(fake_of[pid]), param=group[0])
        setattr(fake_of[pid], _TAG, _Ref(key, None))
    for bid, group in buffer_groups.items():
        key = ("buffer", bid)
        builder.placeholder(key, group[0].replace(".", "_"), recorder.meta(fake_of[bid]), buffer=group[0])
        setattr(fake_of[bid], _TAG, _Ref(key, None))
    excluded = {storages.id_of(t) for t in fake_of.values()}
    saved = _SavedTracker(storages, excluded)

    model.train(not inference)
    for m, k, _, fake in attributes:
        setattr(m, k, fake)
    grads: tuple = ()
    targets: list[torch.Tensor] = []
    state_tensors: list[torch.Tensor] = []
    masters: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []  # inference: the model's outputs, live to the end
    try:
        with quiet, mode, recorder, _module_tracking(recorder, names), \
                tp.reparametrize_module(model, state, strict=False), \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), \
                (CudaRules() if cuda else contextlib.nullcontext()), \
                (BlockReplay(recorder, storages, find_runs(model)) if inference and dedup
                 else TrainReplay(recorder, storages, find_runs(model), saved) if dedup and backward
                 else contextlib.nullcontext()):
            with torch.no_grad() if inference else contextlib.nullcontext(), autocast():
                output = model(*fake_args, **fake_kwargs)
            if inference:
                outputs = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
            else:
                recorder.phase = LOSS
                with autocast():
                    loss = _loss_of(output, loss_output)
                del output  # `loss = model(x).sum()`: the outputs live only as long as the loss needs them
                targets = [fake_of[pid] for pid in param_groups if fake_of[pid].requires_grad]
                if input_requires_grad:
                    targets += [t for _, t in flat_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                if backward and loss.requires_grad and targets:
                    seed = torch.ones_like(loss)
                    recorder.phase = BACKWARD
                    grads = torch.autograd.grad(loss, targets, grad_outputs=seed, allow_unused=True)
                    del seed
                    if optimizer is not None:
                        recorder.phase = OPTIMIZER
                        state_tensors, masters = _optimizer_step(optimizer, param_groups, fake_of, targets,
                                                                 grads, master_weights, recorder)
            storages.open = False  # what is still alive now lives to the end of the step
    except (UsageError, ModelError):
        raise
    except (tp.DataDependentOutputException, tp.DynamicOutputShapeException) as e:
        raise ModelError(
            f"the model's forward depends on tensor values ({type(e).__name__}: {_first_line(e)}), which "
            "fake tensors do not have; move data-dependent control flow (.item(), if tensor:, nonzero) "
            "out of forward or make it shape-only"
        ) from e
    except tp.UnsupportedOperatorException as e:
        raise ModelError(f"an op has no fake-tensor implementation ({e}); fxacct cannot trace it") from e
    except Exception as e:
        raise ModelError(f"the model's {recorder.phase} raised {describe_exception(e)}; {USER_FRAMES_HINT}") from e
    finally:
        storages.open = False
        for m, flag in was_training.items():
            m.training = flag
        for m, k, original, _ in attributes:
            setattr(m, k, original)

    for key, meta in recorder.constants:
        builder.placeholder(key, "constant", meta, constant=True)
    seq_owner: dict[int, fx.Node] = {}
    for index, (func, a, kw, val, phase, module, link, rg) in enumerate(recorder.records):
        if phase == BACKWARD:
            if isinstance(link, tuple):  # ("rec", index): a replayed block's (fxacct.replay_train)
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
    _attach_saved(builder.graph, saved.saved)
    out_refs = [getattr(g, _TAG) for g in grads if g is not None] + [getattr(t, _TAG) for t in outputs]
    builder.graph.output(tuple(builder.lookup(r) for r in out_refs))

    got_grad = {id(t): g is not None for t, g in zip(targets, grads)}
    params = tuple(
        ParamInfo(tuple(group), tuple(fake_of[pid].shape), fake_of[pid].dtype,
                  fake_of[pid].requires_grad, got_grad.get(id(fake_of[pid]), False))
        for pid, group in param_groups.items()
    )
    buffers = tuple(
        ParamInfo(tuple(group), tuple(fake_of[bid].shape), fake_of[bid].dtype, False, False)
        for bid, group in buffer_groups.items()
    )
    opt_state: dict[int, StateTensor] = {}
    for t, count in state_tensors:
        sid = storages.id_of(t)
        opt_state.setdefault(sid, StateTensor(t.dtype, t.untyped_storage().nbytes(), sid, t.dim() == 0, count))
    return Capture(
        builder.graph, params, buffers, tuple(input_nodes), bool(grads), tuple(names.values()),
        tuple(opt_state.values()), frozenset(storages.id_of(g) for g in grads if g is not None),
        frozenset(saved.saved), tuple((storages.id_of(m), m.untyped_storage().nbytes(), c) for m, c in masters),
        inference, dict(storages.deaths),
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


STEP_ALL_BELOW = 64  # parameters; above, one representative per shape is stepped


def _optimizer_step(optimizer, param_groups, fake_of, targets, grads, master_weights: bool, recorder):
    """Build the real optimizer over the trainable fake parameters (DESIGN.md: the usual recipe,
    requires_grad=True), give each the gradient the backward produced, step once. What it
    allocates is what the class allocates, whatever its options. With ``master_weights`` it steps
    fp32 copies (fed fp32 casts of the gradients) and copies them back, as mixed-precision
    recipes with fp32 master weights do.

    torch.optim's single-tensor implementations update each parameter on its own, so parameters
    of one shape and dtype allocate and compute the same: when ``optimizer.per_parameter``, one
    representative per (shape, dtype, has-grad) is stepped and stands for the others (its state
    and ops counted that many times). Foreach/fused implementations and custom classes step all,
    and so do models with few parameters, where stepping all is cheap and keeps one more effect
    exact: a loop's locals (`denom`) outlive their iteration into the next parameter's update.
    Returns ([(state tensor, count)], [(master copy, count)])."""
    params = [fake_of[pid] for pid in param_groups if fake_of[pid].requires_grad]
    is_param = {id(p) for p in params}
    for t, g in zip(targets, grads):
        if g is not None and id(t) in is_param:
            t.grad = g
    if optimizer.per_parameter and len(params) > STEP_ALL_BELOW:
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault((tuple(p.shape), p.dtype, p.grad is not None), []).append(p)
        batches = [([ps[0]], len(ps)) for ps in groups.values()]
    else:
        batches = [(params, 1)]
    states: list[tuple[torch.Tensor, int]] = []
    masters: list[tuple[torch.Tensor, int]] = []
    for batch, count in batches:
        start = len(recorder.records)
        stepped = batch
        if master_weights:
            stepped = [torch.empty(p.shape, dtype=torch.float32) for p in batch]
            for m, p in zip(stepped, batch):
                if p.grad is not None:
                    m.grad = p.grad.float()
            masters += [(m, count) for m in stepped]
        opt = optimizer.build(stepped)
        if opt is None:
            return [], masters
        try:
            opt.step()
        except Exception as e:
            if optimizer.args:  # a value its constructor accepted but its step cannot use
                raise UsageError(f"{type(opt).__name__}.step() failed with options {optimizer.args}: "
                                 f"{describe_exception(e)}; check --optim-arg") from e
            raise
        if master_weights:
            with torch.no_grad():
                for p, m in zip(batch, stepped):
                    p.copy_(m)
        states += [(v, count) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        recorder.repeats.append((start, len(recorder.records), count))
    return states, masters


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
