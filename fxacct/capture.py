"""Capture: one aten-level torch.fx graph of forward + loss + autograd backward, on fake tensors.

How (DESIGN.md, "Facts verified here"): proxy tracing with make_fx costs 3.5× FlopCounterMode, so
fxacct records ops the way FlopCounterMode sees them, in one TorchDispatchMode stacked on a
FakeTensorMode, and builds the fx.Graph from those records afterwards. Each node's meta holds:

- ``val``: the fake output (a tensor, or a tuple for multi-output ops);
- ``phase``: forward / loss / backward;
- ``module``: the FQN from ``named_modules()`` of the module it ran in (global module hooks keep
  the stack; a shared module called twice keeps its one name);
- ``fwd``: for a backward node, the forward node it derives from. A forward op that records an
  autograd Node takes the next sequence number before it reaches the dispatch mode; the backward
  engine runs that Node's ops with ``_current_autograd_node()`` set to it (same number);
- ``saved_bytes``: on the node that allocated a storage, the bytes of that storage autograd saved
  for backward (``saved_tensors_hooks``), deduplicated by storage, parameters and buffers excluded.

The user's module is left as it was: parameters are swapped for fake ones only inside
``reparametrize_module``, and every hook is removed on the way out.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from fxacct import _torch_private as tp
from fxacct.errors import ModelError, UsageError

FORWARD, LOSS, BACKWARD = "forward", "loss", "backward"
_PRIM_DEVICE = torch.ops.prim.device.default


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


class _Recorder(TorchDispatchMode):
    """Records every aten op with its phase, module and autograd sequence link. Nothing else runs
    per op: the graph is built once afterwards (``_GraphBuilder``)."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple] = []
        self.phase = FORWARD
        self.module_stack: list[str] = [""]
        self.last_seq = tp.get_sequence_nr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and isinstance(args[0], tp.FakeTensor):
            # the backward engine asks every gradient for its device; answer as FakeTensor
            # would (its fake_device) without a trip through the fake mode's dispatch
            return args[0].fake_device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # metadata queries, no tensor work
            return out
        if self.phase == BACKWARD:
            node = tp.current_autograd_node()
            link = node._sequence_nr() if node is not None else None
            self.records.append((func, args, kwargs, out, BACKWARD, None, link))
        else:
            hi = tp.get_sequence_nr()
            seqs = range(self.last_seq, hi)
            self.last_seq = hi
            self.records.append((func, args, kwargs, out, self.phase, self.module_stack[-1], seqs))
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
    """Pack hook of ``saved_tensors_hooks``: which storages autograd saves, each once."""

    def __init__(self, excluded: set[int]):
        self.excluded = excluded
        self.saved: dict[int, torch.Tensor] = {}

    def pack(self, t: torch.Tensor):
        key = tp.storage_key(t)
        if key not in self.excluded and key not in self.saved:
            self.saved[key] = t
        return t

    @staticmethod
    def unpack(t):
        return t


def _op_name(func) -> str:
    return getattr(func, "_opname", None) or getattr(func, "__name__", "op")


class _GraphBuilder:
    """Turns the recorder's list into an fx.Graph: tensors are matched to their producers by
    object identity (the records keep them alive, so identities are unique)."""

    def __init__(self):
        self.graph = fx.Graph()
        self.env: dict[int, object] = {}  # id(tensor) -> fx.Node or (multi-output node, index)
        self.storage_owner: dict[int, fx.Node] = {}

    def placeholder(self, name: str, t: torch.Tensor, **meta) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta.update(val=t, phase=FORWARD, module="", **meta)
        self.env[id(t)] = node
        self.storage_owner.setdefault(tp.storage_key(t), node)
        return node

    def lookup(self, t: torch.Tensor) -> fx.Node:
        entry = self.env.get(id(t))
        if entry is None:  # a tensor made outside the traced ops: a constant held by the module
            return self.placeholder("constant", t, constant=True)
        if isinstance(entry, tuple):
            parent, index = entry
            node = self.graph.create_node("call_function", operator.getitem, (parent, index))
            node.meta.update(val=t, phase=parent.meta["phase"], module=parent.meta["module"])
            if "fwd" in parent.meta:
                node.meta["fwd"] = parent.meta["fwd"]
            self.env[id(t)] = node
            return node
        return entry

    def map_arg(self, a):
        if isinstance(a, torch.Tensor):
            return self.lookup(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self.map_arg(x) for x in a)
        return a

    def add(self, func, args, kwargs, out, phase, module) -> fx.Node:
        node = self.graph.create_node(
            "call_function", func, self.map_arg(args), {k: self.map_arg(v) for k, v in kwargs.items()},
            name=_op_name(func),
        )
        node.meta.update(val=out, phase=phase, module=module)
        if isinstance(out, torch.Tensor):
            self.env[id(out)] = node
            self.storage_owner.setdefault(tp.storage_key(out), node)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    self.env[id(o)] = (node, i)
                    self.storage_owner.setdefault(tp.storage_key(o), node)
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
            backward: bool = True) -> Capture:
    """Trace ``model(*args, **kwargs)``, the loss and its backward on fake CPU tensors.

    ``args``/``kwargs`` hold example tensors of any device (meta is fine: only shape, stride and
    dtype are read). With ``dtype``, floating parameters, buffers and inputs are cast to it.
    """
    names = {id(m): n for n, m in model.named_modules()}
    was_training = {m: m.training for m in model.modules()}
    mode = tp.FakeTensorMode()
    recorder = _Recorder()
    builder = _GraphBuilder()
    with mode:
        fake_of: dict[int, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        param_groups: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in fake_of:
                fake_of[id(p)] = _fake_like(p, dtype).requires_grad_(p.requires_grad)
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
            return f.requires_grad_(input_requires_grad and f.is_floating_point())

        fake_args = torch.utils._pytree.tree_map(to_fake, args)
        fake_kwargs = torch.utils._pytree.tree_map(to_fake, kwargs)

    input_nodes = []
    flat_inputs = list(_positional_leaves(model, fake_args))
    flat_inputs += [(k, v) for k, v in kwargs_leaves(fake_kwargs)]
    for name, t in flat_inputs:
        if isinstance(t, torch.Tensor):
            input_nodes.append(builder.placeholder(name, t, kind="input"))
    param_nodes = {}
    for pid, group in param_groups.items():
        param_nodes[pid] = builder.placeholder(group[0].replace(".", "_"), fake_of[pid], param=group[0])
    for bid, group in buffer_groups.items():
        builder.placeholder(group[0].replace(".", "_"), fake_of[bid], buffer=group[0])
    excluded = {tp.storage_key(t) for t in fake_of.values()}
    saved = _SavedTracker(excluded)

    model.train()
    grads: tuple = ()
    targets: list[torch.Tensor] = []
    try:
        with mode, recorder, _module_tracking(recorder, names), \
                tp.reparametrize_module(model, state, strict=False), \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            output = model(*fake_args, **fake_kwargs)
            recorder.phase = LOSS
            loss = _loss_of(output, loss_output)
            targets = [fake_of[pid] for pid in param_groups if fake_of[pid].requires_grad]
            if input_requires_grad:
                targets += [t for _, t in flat_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            do_backward = backward and loss.requires_grad and bool(targets)
            if do_backward:
                seed = torch.ones_like(loss)
                recorder.phase = BACKWARD
                grads = torch.autograd.grad(loss, targets, grad_outputs=seed, allow_unused=True)
    except (UsageError, ModelError):
        raise
    except (tp.DataDependentOutputException, tp.DynamicOutputShapeException) as e:
        raise ModelError(
            f"the model's forward depends on tensor values ({type(e).__name__}: {e}), which fake "
            "tensors do not have; move data-dependent control flow (.item(), if tensor:, nonzero) "
            "out of forward or make it shape-only"
        ) from e
    except tp.UnsupportedOperatorException as e:
        raise ModelError(f"an op has no fake-tensor implementation ({e}); fxacct cannot trace it") from e
    except Exception as e:
        raise ModelError(f"the model's forward/backward raised {type(e).__name__}: {_first_line(e)}") from e
    finally:
        for m, flag in was_training.items():
            m.training = flag

    seq_owner: dict[int, fx.Node] = {}
    for func, a, kw, out, phase, module, link in recorder.records:
        if phase == BACKWARD:
            fwd = seq_owner.get(link) if link is not None else None
            node = builder.add(func, a, kw, out, BACKWARD, fwd.meta["module"] if fwd is not None else "")
            node.meta["fwd"] = fwd
            if fwd is not None and fwd.meta["phase"] == LOSS:
                node.meta["phase"] = LOSS
        else:
            node = builder.add(func, a, kw, out, phase, module)
            for s in link:
                seq_owner[s] = node
    for key, t in saved.saved.items():
        owner = builder.storage_owner.get(key)
        if owner is not None:
            nbytes = t.untyped_storage().nbytes()
            owner.meta.setdefault("saved", []).append((nbytes, t.dtype))
    got_grad = {}
    for t, g in zip(targets, grads):
        got_grad[id(t)] = g is not None
    out_nodes = [builder.lookup(g) for g in grads if g is not None]
    builder.graph.output(tuple(out_nodes))

    params = tuple(
        ParamInfo(tuple(group), tuple(fake_of[pid].shape), fake_of[pid].dtype,
                  fake_of[pid].requires_grad, got_grad.get(id(fake_of[pid]), False))
        for pid, group in param_groups.items()
    )
    buffers = tuple(
        ParamInfo(tuple(group), tuple(fake_of[bid].shape), fake_of[bid].dtype, False, False)
        for bid, group in buffer_groups.items()
    )
    return Capture(builder.graph, params, buffers, tuple(input_nodes), bool(grads), tuple(names.values()))


def _positional_leaves(model, args):
    """(name, tensor) for positional inputs, named after forward's parameters where it has them."""
    try:
        import inspect

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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
