"""Plain data parallelism: ``--mesh dp=N`` alone is DDP, applied with torch's ``replicate``
(DistributedDataParallel on the module in place, its names kept) on the dp dimension.

DDP all-reduces gradients in buckets as they become ready in the backward. Its buckets change
after the first iteration (torch/nn/parallel/distributed.py, _BucketCapacityConfig: the first
iteration puts every parameter in one bucket unless find_unused_parameters; the second forward
re-cuts them in the order the gradients became ready, the first capped at
``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB and the rest at ``bucket_cap_mb`` = 25 MiB,
``_DEFAULT_BUCKET_CAP_MB``): the account is of a steady-state step, so the fake rank runs one
unrecorded warm-up step and the rebuild before the capture. The bucket buffers DDP keeps (one
flat buffer per bucket, the size of the gradients it holds) are resident between steps: they
enter the account as resident tensors when the backward first writes into them.
"""

from __future__ import annotations

import torch

from fxacct.errors import UsageError, classify
from fxacct.trace import torch_private as tp
from fxacct.trace.fake_model import fake_like
from fxacct.trace.loss import training_loss
from fxacct.trace.torch_private import ddp as tpd


def is_ddp(spec) -> bool:
    """dp without fsdp: DDP. (dp with fsdp is HSDP, FSDP2's replicate dimension.)"""
    return spec.size("dp") > 1 and spec.size("fsdp") == 1


def apply_ddp(model: torch.nn.Module, mesh) -> None:
    """replicate(model) on the dp dimension; DDP itself is built on the materialized parameters
    (``ready``), as replicate builds it at the first forward. torch's DDP refuses a module with no
    parameter that requires grad (its constructor raises): a usage error, said first."""
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(f"--mesh dp={mesh['dp'].size()} is DDP, and DDP refuses a model with no parameter that "
                         "requires grad (nothing trains): profile it without --mesh, or with --mesh fsdp=N")
    tpd.replicate_api()(model, device_mesh=mesh["dp"])


def ready(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Inside the FakeTensorMode the parameters were materialized in: build DDP over them, route
    its bucket reduction through the fake process group (tpd.fake_allreduce_hook), then one
    warm-up step (forward, the sum loss, backward; nothing recorded) and the bucket rebuild a real
    second step starts with, so that the captured step is a steady-state one."""
    ddp = tpd.ddp_of(model, build=True)
    if ddp is None:
        return
    ddp.register_comm_hook(ddp.process_group, tpd.fake_allreduce_hook)
    fake_args = tp.tree_map(lambda t: fake_like(t, None) if isinstance(t, torch.Tensor) else t, args)
    fake_kwargs = tp.tree_map(lambda t: fake_like(t, None) if isinstance(t, torch.Tensor) else t, kwargs)
    try:
        loss = training_loss(model(*fake_args, **fake_kwargs))
        if loss.requires_grad:
            loss.backward()
    except Exception as e:
        raise classify(e, "DDP's warm-up step on the fake rank") from e
    finally:
        model.zero_grad(set_to_none=True)
    tpd.rebuild_buckets(ddp)

