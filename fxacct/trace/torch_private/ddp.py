"""torch.distributed's private pieces behind DDP (``replicate``) and ZeRO-1 under the fake
process group, each with the torch line that makes it necessary (torch 2.13)."""

from __future__ import annotations

import contextlib
import sys

import torch

from fxacct.trace.torch_private.required import _require


def replicate_api():
    """torch.distributed._composable.replicate.replicate: DDP applied to a module in place (its
    class and parameter names kept), built lazily at the first forward."""
    import importlib

    _replicate = importlib.import_module("torch.distributed._composable.replicate")
    return _require(_replicate, "replicate", "torch.distributed._composable.replicate")


def ddp_of(model: torch.nn.Module, build: bool = False):
    """The DistributedDataParallel instance ``replicate`` keeps for ``model`` (its ``_ddp``;
    ``build``: construct it now, as the first forward's pre-hook would, _ReplicateState.lazy_init),
    or None when the model is not replicated or not built yet."""
    state = replicate_api().state(model)
    if state is None:
        return None
    if build and not state.has_initialized:
        with _unverified_params():
            state.lazy_init()
    return getattr(state, "_ddp", None)


@contextlib.contextmanager
def _unverified_params():
    """DDP's constructor checks that every rank holds the same parameter shapes
    (torch/nn/parallel/distributed.py, DistributedDataParallel.__init__ ->
    _verify_param_shape_across_processes -> dist._verify_params_across_processes, whose C++
    writes the shapes into a tensor's data): a fake tensor has none. fxacct's ranks are one
    model built by one function, so the check is skipped while the fake rank is built."""
    from torch.nn.parallel import distributed as ddp_module

    original = _require(ddp_module, "_verify_param_shape_across_processes", "torch.nn.parallel.distributed")
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = original


def fake_allreduce_hook(process_group, bucket):  # no annotation: DDP compares it with a type
    """DDP's default reduction of one gradient bucket as a Python comm hook: the fake process
    group's work carries no result, which the C++ default hook asserts on
    (torch/csrc/distributed/c10d/comm.cpp, "expected the hook result is either a Tensor or a
    TensorList"). The same all-reduce of the same bucket buffer, then the division by the world
    size (the C++ path divides while copying the gradients in: reducer.cpp,
    mark_variable_ready_dense, ``at::mul_out(bucket_view, grad, 1 / div_factor_)``)."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=process_group)
    buffer.div_(process_group.size())
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


class _RealIndexTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Integer tensors made while DDP rebuilds its buckets are real: Reducer::sync_bucket_indices
    (torch/csrc/distributed/c10d/reducer.cpp) writes the new bucket assignment into an int tensor
    through its data pointer and broadcasts it from rank 0; under FakeTensorMode it would have no
    data. The bucket buffers themselves (floating) stay fake."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") in (torch.int32, torch.int64):
            with torch.utils._python_dispatch._disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def rebuild_buckets(ddp) -> bool:
    """What DDP's second forward does first (DistributedDataParallel._pre_forward ->
    reducer._rebuild_buckets()): the buckets re-cut in the order the first backward made the
    gradients ready, the first one capped at dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), the others
    at bucket_cap_mb (25 MiB). True when it rebuilt them."""
    with _RealIndexTensors():
        return ddp.reducer._rebuild_buckets()


def zero_local_optimizer(opt):
    """The optimizer a ZeroRedundancyOptimizer steps for this rank's partition
    (torch/distributed/optim/zero_redundancy_optimizer.py: ``self.optim``), whose ``state`` is
    the rank's optimizer state; ``opt`` itself for any other optimizer. Its module is looked up,
    not imported: a ZeroRedundancyOptimizer exists only once it has been, and importing
    torch.distributed.optim scripts its functional optimizers (0.17 s of every profile's CPU)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return opt.optim if zero is not None and isinstance(opt, zero.ZeroRedundancyOptimizer) else opt
