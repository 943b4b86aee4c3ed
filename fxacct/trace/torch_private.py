"""Every private PyTorch API fxacct relies on, in one place.

Each name is looked up once at import; if a torch release moves one, fxacct fails here with a
message naming the API instead of mis-counting later. tests/test_torch_private.py pins the
behaviour each one must have.
"""

import contextlib
import inspect

import torch

from fxacct.errors import FxacctError, called_by_torch


def _require(owner, name: str, where: str):
    fn = getattr(owner, name, None)
    if fn is None:
        raise FxacctError(
            f"this torch ({torch.__version__}) has no {where}.{name}, which fxacct needs; "
            "install a torch release fxacct supports (torch>=2.13,<=2.14.1, docs/compat.md)"
        )
    return fn


# The autograd Node currently executing in the backward engine (None outside backward). Its
# sequence number equals the one its forward op got: this links a backward op to its forward op
# (the same link AOTAutograd uses, see torch/fx/proxy.py "NOTE [ Sequence Number ]").
current_autograd_node = _require(torch._C, "_current_autograd_node", "torch._C")


def current_autograd_number() -> int | None:
    """The sequence number of the autograd Node the backward engine is running, or None."""
    node = current_autograd_node()
    return node._sequence_nr() if node is not None else None

# The next autograd sequence number on this thread; a forward op that records a grad_fn takes one
# before it redispatches below autograd, so a dispatch mode sees it already taken.
next_autograd_number = _require(torch.autograd, "_get_sequence_nr", "torch.autograd")

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

def local(t):
    """A DTensor's shard on this rank (its ``_local_tensor``); any other tensor itself."""
    return getattr(t, "_local_tensor", t) if t is not None else None


def fake_store():
    """The in-memory store of the "fake" process group (torch.testing's fake_pg): no peers, no
    network; every collective returns at once with outputs of the right shape."""
    from torch.testing._internal.distributed import fake_pg

    return _require(fake_pg, "FakeStore", "torch.testing._internal.distributed.fake_pg")()


@__import__("contextlib").contextmanager
def dtensor_meta_unrecorded():
    """DTensor infers an op's global output shape by running the op once on fake global tensors
    in the active FakeTensorMode (ShardingPropagator._propagate_tensor_meta_non_cached, on a cache
    miss); a dispatch mode on the stack would see that run as if the rank computed it. Inside this
    context that inference runs with every mode off (it makes its own FakeTensorMode then)."""
    from torch.distributed.tensor import _sharding_prop

    cls = _require(_sharding_prop, "ShardingPropagator", "torch.distributed.tensor._sharding_prop")
    original = _require(cls, "_propagate_tensor_meta_non_cached", "ShardingPropagator")

    def outside_modes(self, *args, **kwargs):
        with _python_dispatch._disable_current_modes():
            return original(self, *args, **kwargs)

    cls._propagate_tensor_meta_non_cached = outside_modes
    try:
        yield
    finally:
        cls._propagate_tensor_meta_non_cached = original


@__import__("contextlib").contextmanager
def shared_mesh_concatenation():
    """FSDP2 over a tensor-parallel mesh builds a new DeviceMesh for every DTensor parameter by
    concatenating the same two meshes (DeviceMesh._concatenate, from FSDPParam's sharding spec),
    which on a 70B model is a third of fully_shard's time. The result is a pure function of the
    meshes, so inside this context one concatenation of each distinct list is built and shared."""
    from torch.distributed import device_mesh as _device_mesh

    cls = _require(_device_mesh, "DeviceMesh", "torch.distributed.device_mesh")
    original = _require(cls, "_concatenate", "DeviceMesh")
    made: dict[tuple, tuple] = {}

    @called_by_torch
    def concatenate(device_mesh_list):
        key = tuple(map(id, device_mesh_list))
        if key not in made:  # the meshes are kept with the result, so their ids stay theirs
            made[key] = (tuple(device_mesh_list), original(device_mesh_list))
        return made[key][1]

    cls._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        cls._concatenate = staticmethod(original)


@__import__("contextlib").contextmanager
def fsdp_storage_resizes(on_resize):
    """FSDP2 frees an unsharded parameter by resizing its storage to 0 and gathers into it again
    after resizing it back (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``free_storage``
    / ``alloc_storage``), outside the dispatcher. Inside this context each such resize also calls
    ``on_resize(tensor, allocated: bool)``."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    free = _require(_fsdp_param, "free_storage", "torch.distributed.fsdp._fully_shard._fsdp_param")
    alloc = _require(_fsdp_param, "alloc_storage", "torch.distributed.fsdp._fully_shard._fsdp_param")

    @called_by_torch
    def free_storage(tensor):
        free(tensor)
        on_resize(tensor, False)

    @called_by_torch
    def alloc_storage(tensor):
        alloc(tensor)
        on_resize(tensor, True)

    _fsdp_param.free_storage, _fsdp_param.alloc_storage = free_storage, alloc_storage
    _fsdp_param_group.alloc_storage = alloc_storage
    try:
        yield
    finally:
        _fsdp_param.free_storage, _fsdp_param.alloc_storage, _fsdp_param_group.alloc_storage = free, alloc, alloc


class TorchCall:
    """One call torch made to a function of its own that fxacct replaced (``replaced``): the
    arguments bound to the replaced function's signature, by parameter name, whatever this release
    passes (torch 2.15 added a keyword to FSDP2's copy-out that 2.13 does not have)."""

    def __init__(self, original, signature: "inspect.Signature", args: tuple, kwargs: dict):
        self.original, self.args, self.kwargs = original, args, kwargs
        self.arguments = signature.bind(*args, **kwargs).arguments
        self.parameters = signature.parameters

    def get(self, name: str, default=None):
        return self.arguments.get(name, default)

    def at_defaults_except(self, names) -> bool:
        """Whether every argument other than ``names`` has the value the replaced function would
        take without it (its default): only then does a replacement that knows ``names`` alone
        do what the original would."""
        return all(name in names or _is_default(value, self.parameters[name].default)
                   for name, value in self.arguments.items())

    def run(self):
        """The replaced function, called exactly as torch called it."""
        return self.original(*self.args, **self.kwargs)


def _is_default(value, default) -> bool:
    if value is default:
        return True
    plain = (type(None), bool, int, float, str)
    return isinstance(value, plain) and isinstance(default, plain) and value == default


@contextlib.contextmanager
def replaced(owner, name: str, replacement, where: str):
    """Inside this context ``owner.name`` (a function of torch's that torch itself calls) runs
    ``replacement(TorchCall)`` instead. The replacement never sees torch's arguments positionally,
    so a release that adds or reorders arguments reaches it by name; the call itself lands in a
    frame of fxacct's, so an exception there is fxacct's (fxacct.errors)."""
    original = _require(owner, name, where)
    signature = inspect.signature(original)

    def called(*args, **kwargs):
        return replacement(TorchCall(original, signature, args, kwargs))

    setattr(owner, name, called)
    try:
        yield
    finally:
        setattr(owner, name, original)


# FSDP2's parameter names for the arguments fxacct's gather replay reads (fxacct.parallel.fsdp_replay),
# in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: ``foreach_all_gather(fsdp_params,
# group, async_op, all_gather_copy_in_stream, all_gather_stream, device, all_gather_comm)`` and
# ``foreach_all_gather_copy_out(all_gather_result, fsdp_params, group)``; torch 2.15 adds the keyword
# ``all_gather_output_fn`` to the copy-out (its ``_default_all_gather_output_fn`` does what earlier
# releases did inline), which FSDPParamGroup.wait_for_unshard passes.
FSDP_GATHER_ARGS = ("fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream", "device",
                    "all_gather_comm")
FSDP_COPY_OUT_ARGS = ("all_gather_result", "fsdp_params", "group")


@contextlib.contextmanager
def fsdp_gathers_patched(all_gather, copy_out):
    """FSDP2's parameter groups call ``foreach_all_gather`` to gather a group's shards and
    ``foreach_all_gather_copy_out`` to copy them into the unsharded parameters
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, ``unshard`` and
    ``wait_for_unshard``). Inside this context they call ``all_gather(call)`` and
    ``copy_out(call)`` instead, with ``call`` a TorchCall: its arguments by the names in
    FSDP_GATHER_ARGS and FSDP_COPY_OUT_ARGS (``get`` gives None for one this release lacks), whether
    every other argument is at its default (``at_defaults_except``), and ``run()``, the original."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    where = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
    with replaced(group_module, "foreach_all_gather", all_gather, where), \
            replaced(group_module, "foreach_all_gather_copy_out", copy_out, where):
        yield


def fsdp_reduce_scatter_copy_ins() -> tuple:
    """The ops FSDP2's reduce-scatter copies the unsharded gradients into its input buffer with
    (``foreach_reduce_scatter_copy_in``, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
    ``fsdp.chunk_cat`` up to torch 2.14; torch 2.15 calls ``fsdp.chunk_cat_mixed_dtype`` there (the
    same schema, gradients of mixed dtypes allowed) and keeps ``fsdp.chunk_cat`` defined, unused.
    Each one this release defines."""
    import torch.distributed.fsdp  # noqa: F401  (defines torch.ops.fsdp)

    return tuple(getattr(torch.ops.fsdp, name).default for name in ("chunk_cat", "chunk_cat_mixed_dtype")
                 if hasattr(torch.ops.fsdp, name))


def fsdp_copy_ops() -> tuple:
    """Every op FSDP2 copies with around its collectives: ``fsdp.all_gather_copy_in``,
    ``fsdp.split_with_sizes_copy`` and the reduce-scatter copy-ins of this release."""
    import torch.distributed.fsdp  # noqa: F401  (defines torch.ops.fsdp)

    return (torch.ops.fsdp.all_gather_copy_in.default, torch.ops.fsdp.split_with_sizes_copy.default,
            *fsdp_reduce_scatter_copy_ins())


def fsdp_param_shard(fsdp_param):
    """An FSDPParam's flat local shard, what its all-gather reads (``_sharded_param_data``), or
    None where the all-gather reads something else: an all-gather extension
    (``fsdp_pre_all_gather``), CPU offload, or a shard resharded to a smaller post-forward mesh."""
    if fsdp_param.sharded_state.name != "SHARDED" or fsdp_param.offload_to_cpu \
            or hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
        return None
    return fsdp_param._sharded_param_data



def reduce_op_type(o) -> int | None:
    """The reduction (``ReduceOp.RedOpType``'s value: SUM 0, ..., MAX 4) of a c10d op's ReduceOp
    argument, boxed as a ScriptObject of ``torch.classes.c10d.ReduceOp`` (its ``op`` method is all
    it exposes); None for another ScriptObject."""
    qualified = o._type().qualified_name() if hasattr(o, "_type") else ""
    if not qualified.endswith("c10d.ReduceOp") or not o._has_method("op"):
        return None
    return int(o._get_method("op")())

# The classes of torch.ops.NAMESPACE.OP (a packet) and torch.ops.NAMESPACE.OP.OVERLOAD: what
# fxacct.costs.register accepts as a key.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

from torch import overrides as _overrides  # noqa: E402

# The TorchFunctionModes active on this thread, outermost first (the backward engine runs
# activation checkpointing's recompute without them: fxacct.trace.checkpointing re-enters them).
function_mode_stack = _require(_overrides, "_get_current_function_mode_stack", "torch.overrides")


def pipeline_order(schedule_cls, stages: int, microbatches: int, per_rank: int = 1) -> dict:
    """rank -> [(computation type "F"/"B"/..., stage index, micro-batch) or None (an idle slot)]:
    the per-rank action lists a torch.distributed.pipelining schedule builds when it is made
    (its ``pipeline_order``), made here over stand-in stages (nn.Identity: the order depends on the
    stage and micro-batch counts alone) of rank 0 under the fake process group of ``stages`` ranks:
    stage 0 of ``stages``, or under interleaving stages 0, P, 2P, ... of P·``per_rank``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    if dist.is_initialized():
        raise FxacctError("fxacct simulates a pipeline schedule under a fake process group of its own; "
                          "call it outside your torch.distributed process group")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=stages)
    try:
        total = stages * per_rank
        mine = [PipelineStage(torch.nn.Identity(), s, total, torch.device("cpu")) for s in range(0, total, stages)]
        schedule = schedule_cls(mine if per_rank > 1 else mine[0], n_microbatches=microbatches)
        order = _require(schedule, "pipeline_order", f"{schedule_cls.__name__} instance")
    finally:
        dist.destroy_process_group()
    return {rank: [None if a is None else (a.computation_type.value, a.stage_index, a.microbatch_index)
                   for a in actions] for rank, actions in order.items()}


def comm_debug_collectives() -> frozenset:
    """The op packets torch's CommDebugMode counts as collectives: its functional-collective
    registry and c10d's collectives (torch/distributed/tensor/debug/_comm_mode.py,
    ``CommDebugMode.comm_registry`` and ``c10d_collective_ops``)."""
    from torch.distributed.tensor.debug import CommDebugMode, _comm_mode

    c10d = _require(_comm_mode, "c10d_collective_ops", "torch.distributed.tensor.debug._comm_mode")
    return frozenset(CommDebugMode().comm_registry) | frozenset(c10d)


def composable_state_keys() -> frozenset:
    """The attribute names under which torch.distributed's composable APIs (``fully_shard``) keep
    each module's state and registry (torch/distributed/_composable/contract.py, ``STATE_KEY`` and
    ``REGISTRY_KEY``): dicts of per-module objects. Empty while that module is not loaded (no
    module can carry them then)."""
    import sys

    contract = sys.modules.get("torch.distributed._composable.contract")
    if contract is None:
        return frozenset()
    return frozenset(k for k in (getattr(contract, "STATE_KEY", None), getattr(contract, "REGISTRY_KEY", None)) if k)


def no_python_dispatch():
    """Ops run their kernels directly, below every TorchDispatchMode and tensor subclass."""
    return torch._C._DisableTorchDispatch()


from torch.utils import checkpoint as _checkpoint  # noqa: E402


def _checkpoint_recompute_codes() -> frozenset:
    """The code objects activation checkpointing recomputes a forward in (torch/utils/checkpoint.py):
    the non-reentrant variant's ``recompute_fn``, a closure of ``_checkpoint_without_reentrant_generator``
    called from the unpack hook of a saved tensor. (The reentrant variant refuses torch.autograd.grad,
    which a capture calls, so it never runs here.)"""
    import types

    generator = _require(_checkpoint, "_checkpoint_without_reentrant_generator", "torch.utils.checkpoint")
    codes = {c for c in generator.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "recompute_fn"}
    if not codes:
        raise FxacctError(f"this torch ({torch.__version__}) has no recompute_fn in "
                          "torch.utils.checkpoint._checkpoint_without_reentrant_generator, which fxacct needs")
    return frozenset(codes)


_RECOMPUTE_CODES = _checkpoint_recompute_codes()


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
