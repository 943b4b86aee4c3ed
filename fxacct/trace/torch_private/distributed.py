"""torch.distributed's private APIs fxacct relies on: the fake process group, DTensor's sharding
propagation and device meshes, FSDP2's parameters, gathers and copy ops, pipelining's schedule
orders, CommDebugMode's registry. Part of fxacct.trace.torch_private (its names are re-exported
there); tests/test_torch_private.py pins their behaviour."""

import contextlib
import inspect

import torch
from torch.utils import _python_dispatch

from fxacct.errors import FxacctError, called_by_torch
from fxacct.trace.torch_private.required import _require


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
    context that inference runs with every mode off but one FakeTensorMode of its own, made once
    for the context: with none active, torch would make one per inference, and a FakeTensorMode's
    constructor walks the whole Python stack (traceback.extract_stack), deep inside a capture."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    cls = _require(_sharding_prop, "ShardingPropagator", "torch.distributed.tensor._sharding_prop")
    original = _require(cls, "_propagate_tensor_meta_non_cached", "ShardingPropagator")
    own: list = []  # the context's FakeTensorMode, made at the first inference

    def outside_modes(self, *args, **kwargs):
        with _python_dispatch._disable_current_modes():
            if not own:
                own.append(FakeTensorMode())
            with own[0]:
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
# ``foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
# reduce_scatter_comm, orig_dtype, reduce_dtype, device, gradient_divide_factor, all_reduce_group,
# all_reduce_stream, all_reduce_grads, partial_reduce_output, all_reduce_hook,
# force_sum_reduction_for_comms)``, which FSDPParamGroup.post_backward calls
FSDP_REDUCE_ARGS = ("fsdp_params", "unsharded_grads", "reduce_scatter_group", "reduce_scatter_stream",
                    "reduce_scatter_comm", "orig_dtype", "reduce_dtype", "device", "gradient_divide_factor",
                    "all_reduce_group", "all_reduce_stream", "all_reduce_grads", "partial_reduce_output",
                    "all_reduce_hook", "force_sum_reduction_for_comms")


@contextlib.contextmanager
def fsdp_gathers_patched(all_gather, copy_out, reduce):
    """FSDP2's parameter groups call ``foreach_all_gather`` to gather a group's shards,
    ``foreach_all_gather_copy_out`` to copy them into the unsharded parameters and
    ``foreach_reduce`` to reduce-scatter the gradients into the sharded parameters' ``.grad``
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, ``unshard``, ``wait_for_unshard``
    and ``post_backward``). Inside this context they call ``all_gather(call)``, ``copy_out(call)``
    and ``reduce(call)`` instead, with ``call`` a TorchCall: its arguments by the names in
    FSDP_GATHER_ARGS, FSDP_COPY_OUT_ARGS and FSDP_REDUCE_ARGS (``get`` gives None for one this
    release lacks), whether every other argument is at its default (``at_defaults_except``), and
    ``run()``, the original."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    where = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
    with replaced(group_module, "foreach_all_gather", all_gather, where), \
            replaced(group_module, "foreach_all_gather_copy_out", copy_out, where), \
            replaced(group_module, "foreach_reduce", reduce, where):
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
