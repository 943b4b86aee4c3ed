"""Every private PyTorch API fxacct relies on, in one place.

Each name is looked up once at import; if a torch release moves one, fxacct fails here with a
message naming the API instead of mis-counting later. tests/test_torch_private.py pins the
behaviour each one must have.
"""

import functools

import torch

from fxacct.errors import FxacctError
from fxacct.trace.torch_private.required import _require

# The autograd Node currently executing in the backward engine (None outside backward). Its
# sequence number equals the one its forward op got: this links a backward op to its forward op
# (the same link AOTAutograd uses, see torch/fx/proxy.py "NOTE [ Sequence Number ]").
current_autograd_node = _require(torch._C, "_current_autograd_node", "torch._C")


# The backward node that stores a leaf's gradient in .grad (loss.backward()); it detaches the
# gradient it keeps (torch/csrc/autograd/functions/accumulate_grad.h, accumulateGrad).
AccumulateGrad = _require(torch._C._functions, "AccumulateGrad", "torch._C._functions")


def in_accumulate_grad() -> bool:
    """Whether the backward engine is running a leaf's AccumulateGrad now."""
    return isinstance(current_autograd_node(), AccumulateGrad)


def current_autograd_number() -> int | None:
    """The sequence number of the autograd Node the backward engine is running, or None."""
    node = current_autograd_node()
    return node._sequence_nr() if node is not None else None

# The innermost saved_tensors_hooks now in force on this thread: (pack, unpack), or None.
_top_saved_tensors_hooks = _require(torch._C._autograd, "_top_saved_tensors_default_hooks", "torch._C._autograd")


def top_saved_tensors_pack():
    """The pack hook autograd saves a tensor through here and now (torch.utils.checkpoint's, inside
    a checkpointed region), or None."""
    hooks = _top_saved_tensors_hooks(False)
    return None if hooks is None else hooks[0]


# The next autograd sequence number on this thread; a forward op that records a grad_fn takes one
# before it redispatches below autograd, so a dispatch mode sees it already taken.
next_autograd_number = _require(torch.autograd, "_get_sequence_nr", "torch.autograd")


def has_newest_grad_fn(t: torch.Tensor) -> bool:
    """Whether ``t``'s grad_fn is the newest autograd Node of this thread: in a saved-tensor pack
    hook, whether the op saving ``t`` made it (an op saves its own output after giving it its
    grad_fn; an input's is older, the saving Node having taken its number before the op ran)."""
    fn = t.grad_fn
    return fn is not None and fn._sequence_nr() == next_autograd_number() - 1

from torch.nn.utils import stateless as _stateless  # noqa: E402

# Swap a module's parameters and buffers for other tensors, restoring them on exit.
reparametrize_module = _require(_stateless, "_reparametrize_module", "torch.nn.utils.stateless")

from torch._subclasses import fake_tensor as _fake_tensor  # noqa: E402

FakeTensorMode = _require(_fake_tensor, "FakeTensorMode", "torch._subclasses.fake_tensor")
FakeTensor = _require(_fake_tensor, "FakeTensor", "torch._subclasses.fake_tensor")
# The context FakeTensorMode runs a meta kernel in, its fake tensors acting as meta ones.
in_kernel_invocation_manager = _require(
    _fake_tensor, "in_kernel_invocation_manager", "torch._subclasses.fake_tensor"
)
# FakeTensorMode's own op dispatch past its cache: what its cached path runs on a miss or bypass.
fake_dispatch_uncached = _require(FakeTensorMode, "_dispatch_impl", "FakeTensorMode")
# Raised when a model's Python code needs a tensor's value (data-dependent control flow).
DataDependentOutputException = _require(
    _fake_tensor, "DataDependentOutputException", "torch._subclasses.fake_tensor"
)
DynamicOutputShapeException = _require(
    _fake_tensor, "DynamicOutputShapeException", "torch._subclasses.fake_tensor"
)
UnsupportedOperatorException = _require(
    _fake_tensor, "UnsupportedOperatorException", "torch._subclasses.fake_tensor"
)


def storage_key(t: torch.Tensor) -> int:
    """An identity for the storage behind t: equal for a tensor and all its views."""
    return t.untyped_storage()._cdata


def key_of_storage(st: torch.UntypedStorage) -> int:
    """storage_key of a tensor whose untyped storage is ``st``."""
    return st._cdata


def fx_append_node(graph, op: str, target, args: tuple, kwargs: dict, name: str):
    """torch.fx.Graph.create_node without its per-node pytree walk over the arguments (a warning
    check for raw SymInts, which fake tensors with static shapes never produce): a third of the
    cost of building a large graph. Falls back to create_node where fx's internals differ."""
    try:
        namespace, insert, table = graph._graph_namespace, graph._insert, graph._find_nodes_lookup_table
    except AttributeError:
        return graph.create_node(op, target, args, kwargs, name=name)
    name = namespace.create_name(name, None)
    node = torch.fx.Node(graph, name, op, target, args, kwargs or {}, None)
    namespace.associate_name_with_obj(name, node)
    insert(node)
    table.insert(node)
    graph._len += 1
    return node


def fx_node_name(graph, candidate: str) -> str:
    """The name fx_append_node would give the graph's next node made from ``candidate``, taken
    in the graph's namespace with no node made (a capture read for its peak alone:
    fxacct.trace.graph_builder.OpList). Falls back to making the node and erasing it."""
    try:
        return graph._graph_namespace.create_name(candidate, None)
    except AttributeError:
        node = graph.create_node("call_function", _no_op, (), {}, name=candidate)
        graph.erase_node(node)
        return node.name


def _no_op():
    return None


from torch.utils import _pytree  # noqa: E402

# Flattening nested Python containers (tuples, lists, dicts, namedtuples, HF ModelOutputs) the way
# torch does: model inputs and outputs.
tree_leaves = _pytree.tree_leaves
tree_map = _pytree.tree_map
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten

# The logger FakeTensorMode writes a kernel's traceback to before re-raising it.
FAKE_TENSOR_LOGGER = _fake_tensor.__name__

from torch.utils import _python_dispatch  # noqa: E402

# The dispatch-mode base class (what FlopCounterMode builds on) and its tensor-subclass test.
TorchDispatchMode = _python_dispatch.TorchDispatchMode
is_traceable_wrapper_subclass = _python_dispatch.is_traceable_wrapper_subclass


def kineto_events(prof):
    """The raw kineto events of a finished torch.profiler.profile (memory events included), or
    None where this torch keeps them elsewhere."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    return results.events() if results is not None else None


def schema_arguments(op) -> tuple[tuple[str, bool], ...]:
    """(name, kwarg_only) of each argument in an OpOverload's schema, in order (fxacct.costs reads
    arguments by name: positions differ between overloads and kernels)."""
    return tuple((a.name, a.kwarg_only) for a in op._schema.arguments)


def returns_nothing(op) -> bool:
    """Whether an OpOverload's schema returns nothing (``-> ()``: an op that only writes into its
    ``out`` arguments, as FSDP2's copies do)."""
    return not op._schema.returns


# Run real tensors past every active dispatch mode (fake tensors, the recorder): the small known
# values of fxacct.trace.known_values are computed for real beside the traced op.
disable_current_modes = _require(_python_dispatch, "_disable_current_modes", "torch.utils._python_dispatch")
# How many TorchDispatchModes a mode's __torch_dispatch__ has below it (itself popped while it runs), the
# fake mode included.
dispatch_modes_below = _require(_python_dispatch, "_len_torch_dispatch_stack", "torch.utils._python_dispatch")


def fake_mode_in_force():
    """The FakeTensorMode on this thread's dispatch mode stack, or None."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


# kineto (torch.profiler's backend) logs through its own logger, not Python's: at its default level it
# writes "USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start" and "profiler_stop" lines to
# stderr around every profile. It reads KINETO_LOG_LEVEL once, when the first profile in the process
# initialises it (libkineto init.cpp), and prints messages whose level is at least that one; its
# levels (ILoggerObserver.h) are VERBOSE 0, INFO 1, WARNING 2, STAGE 3, ERROR 4, USDT 5, so 6 prints
# none. Verified on torch 2.13: set after `import torch` and before the first profile, no line.
KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"
KINETO_SILENT = "6"


def quiet_kineto() -> None:
    """Silence kineto's log lines for this process, unless the user set KINETO_LOG_LEVEL. Call before
    the first torch.profiler.profile starts (kineto reads the variable once, at its initialisation)."""
    import os

    os.environ.setdefault(KINETO_LOG_LEVEL, KINETO_SILENT)

def set_cuda_allocator_settings(conf: str) -> None:
    """The CUDA caching allocator's settings for this process from now on, as PYTORCH_CUDA_ALLOC_CONF
    gives them at start-up (torch.cuda.memory._set_allocator_settings: ``expandable_segments``, the
    rounding and split options take effect for the allocations that follow)."""
    import torch.cuda.memory as cuda_memory

    _require(cuda_memory, "_set_allocator_settings", "torch.cuda.memory")(conf)


def local(t):
    """A DTensor's shard on this rank (its ``_local_tensor``); any other tensor itself."""
    return getattr(t, "_local_tensor", t) if t is not None else None


OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

from torch import overrides as _overrides  # noqa: E402

# The TorchFunctionModes active on this thread, outermost first (the backward engine runs
# activation checkpointing's recompute without them: fxacct.trace.checkpointing re-enters them).
function_mode_stack = _require(_overrides, "_get_current_function_mode_stack", "torch.overrides")


def no_python_dispatch():
    """Ops run their kernels directly, below every TorchDispatchMode and tensor subclass."""
    return torch._C._DisableTorchDispatch()


def no_torch_function():
    """Every TorchFunctionMode and subclass ``__torch_function__`` off: for fxacct's own reads of
    tensor metadata inside a capture (a storage, strides, requires_grad, a parameter list), which
    otherwise each pass through the capture's function modes (fxacct.trace.dispatch_recorder's
    AttentionScope, fxacct.trace.targets' CudaRules) at 2-4 us a read: about 20k reads in the
    bookkeeping of a 70B step's replayed blocks, optimizer and saved tensors. Never around the
    model's own code, whose calls those modes are there to see. (Inside a dispatch mode's
    ``__torch_dispatch__`` torch has them off already.)"""
    return torch._C.DisableTorchFunction()


def torch_function_off(fn):
    """``fn`` run under no_torch_function()."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return run


from torch.utils import checkpoint as _checkpoint  # noqa: E402


def _checkpoint_recompute_codes() -> frozenset:
    """The code objects activation checkpointing recomputes a forward in (torch/utils/checkpoint.py):
    the non-reentrant variant's ``recompute_fn``, a closure of ``_checkpoint_without_reentrant_generator``
    called from the unpack hook of a saved tensor, and the reentrant variant's
    ``CheckpointFunction.backward``, which runs the forward again under enable_grad and then a backward
    of it (whose ops, under no_grad, make no autograd node: not a recompute)."""
    import types

    generator = _require(_checkpoint, "_checkpoint_without_reentrant_generator", "torch.utils.checkpoint")
    codes = {c for c in generator.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "recompute_fn"}
    if not codes:
        raise FxacctError(f"this torch ({torch.__version__}) has no recompute_fn in "
                          "torch.utils.checkpoint._checkpoint_without_reentrant_generator, which fxacct needs")
    reentrant = _require(_checkpoint, "CheckpointFunction", "torch.utils.checkpoint")
    return frozenset(codes | {reentrant.backward.__code__})


_RECOMPUTE_CODES = _checkpoint_recompute_codes()

# Whether AOTAutograd (a make_fx proxy mode) is tracing now: torch.utils.checkpoint's own test,
# under which its selective-checkpoint dispatch mode tags graph nodes for the partitioner instead
# of caching and recomputing (torch/utils/checkpoint.py, _CachingTorchDispatchMode).
aot_tracing = _require(_checkpoint, "_is_compiling", "torch.utils.checkpoint")


def in_checkpoint_recompute() -> bool:
    """Whether torch.utils.checkpoint is recomputing a forward on this thread's Python stack now
    (a custom autograd.Function's backward that re-runs forward ops is not)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _RECOMPUTE_CODES:
            return True
        frame = frame.f_back
    return False


# torch.distributed's private APIs (FSDP2, DTensor, pipelining, the fake process group)
from fxacct.trace.torch_private.distributed import (  # noqa: E402,F401,I001  (re-exported)
    FSDP_COPY_OUT_ARGS, FSDP_GATHER_ARGS, FSDP_REDUCE_ARGS, TorchCall, comm_debug_collectives, composable_state_keys, dtensor_meta_unrecorded, fake_store, fsdp_copy_ops, fsdp_gathers_patched, fsdp_param_shard, fsdp_reduce_scatter_copy_ins, fsdp_storage_resizes, pipeline_order, reduce_op_type, replaced, shared_mesh_concatenation,
)
