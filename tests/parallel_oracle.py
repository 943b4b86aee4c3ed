"""The oracle for --mesh tests, independent of fxacct's capture: the same model and the same
parallelize function run eagerly on real CPU tensors under the in-process "fake" process group
(rank 0 of the mesh's world size), one step (forward, loss, backward, AdamW step), while a
dispatch counter records every collective the engine issues below the DTensor layer (the way
torch.distributed.tensor.debug.CommDebugMode sees them), with its output buffer's bytes taken
from the real tensors."""

from __future__ import annotations

import contextlib
import importlib.util
from collections import Counter

import torch
import torch.distributed as dist
from helpers import ROOT
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from fxacct.runtime.storage_tracker import default_loss

NAMES = {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "all_reduce", "allreduce_": "all_reduce"}
WRITES_ARG0 = {"_allgather_base_", "_reduce_scatter_base_", "allreduce_"}


class CollectiveCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional") and name in NAMES:
            buf = args[0] if name in WRITES_ARG0 else out
            buf = buf[0] if isinstance(buf, (list, tuple)) else buf
            self.count[NAMES[name]] += 1
            self.bytes[NAMES[name]] += buf.numel() * buf.element_size()
        return out


def load(rel: str):
    path, _, name = rel.rpartition(":")
    spec = importlib.util.spec_from_file_location(f"oracle_{path.replace('/', '_')[:-3]}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def eager_collectives(model_fn, parallelize, dims: dict, inputs) -> tuple[Counter, Counter, dict]:
    """(count by op, output-buffer bytes by op, CommDebugMode's counts by op name) of one step."""
    world = 1
    for size in dims.values():
        world *= size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        torch.manual_seed(0)
        model = model_fn()
        model = parallelize(model, mesh) or model  # a parallelize that returns None changed it in place
        opt = torch.optim.AdamW(model.parameters())
        counter, debug = CollectiveCounter(), CommDebugMode()
        with debug, counter:
            loss = default_loss(model(*inputs))  # DESIGN.md: the sum of t.float().sum() over floating outputs
            loss.backward()
            opt.step()
        comm = {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}
        return counter.count, counter.bytes, comm
    finally:
        dist.destroy_process_group()


def fxacct_collectives(doc: dict) -> tuple[Counter, Counter]:
    count, nbytes = Counter(), Counter()
    for c in doc["collectives"]:
        count[c["op"]] += c["count"]
        nbytes[c["op"]] += c["bytes"]
    return count, nbytes


def eager_peak(model_fn, parallelize, dims: dict, inputs, inference: bool = False, amp=None) -> int:
    """The op-level peak of one steady-state training step on rank 0 (fxacct.runtime's
    StorageTracker, as fxacct.runtime.storage_tracker.measure_training_step runs it: a warm-up
    step, zero_grad(set_to_none=True), then the tracked step), with FSDP2's storage resizes (made
    outside the dispatcher) shown to the tracker as they happen. ``inference``: after the same
    warm-up, one forward in eval mode under no_grad is tracked instead (parameters, buffers and
    inputs resident, as measure_inference counts them). ``amp``: the forward and loss under
    autocast to that dtype, as --amp runs them."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    from fxacct.runtime.storage_tracker import StorageTracker, _gc_paused

    world = 1
    for size in dims.values():
        world *= size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    free, alloc = _fsdp_param.free_storage, _fsdp_param.alloc_storage
    tracker = StorageTracker()

    def seen(fn):
        def wrapped(tensor):
            fn(tensor)
            with tracker._lock:
                tracker._see(tensor.untyped_storage())
        return wrapped

    try:
        mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        torch.manual_seed(0)
        model = model_fn()
        model = parallelize(model, mesh) or model  # a parallelize that returns None changed it in place
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

        def step():
            with torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext():
                loss = default_loss(model(*inputs))  # DESIGN.md: the sum of t.float().sum() over floating outputs
            loss.backward()
            opt.step()
            return loss

        step()
        opt.zero_grad(set_to_none=True)
        _fsdp_param.free_storage, _fsdp_param.alloc_storage = seen(free), seen(alloc)
        _fsdp_param_group.alloc_storage = _fsdp_param.alloc_storage
        with _gc_paused(), tracker:
            if inference:
                model.eval()
                tracker.track(model, inputs)
                with torch.no_grad():
                    out = model(*inputs)  # noqa: F841  (alive to the end, as fxacct counts outputs)
            else:
                tracker.track(model, opt, inputs)
                step()
        return tracker.peak_bytes
    finally:
        _fsdp_param.free_storage, _fsdp_param.alloc_storage, _fsdp_param_group.alloc_storage = free, alloc, alloc
        dist.destroy_process_group()


def predicted_by_op(rows) -> dict[str, list[int]]:
    """{op: [count, bytes]} of an account's collective rows, the form a gloo rank reports."""
    out: dict[str, list[int]] = {}
    for r in rows:
        acc = out.setdefault(r.op, [0, 0])
        acc[0] += r.count
        acc[1] += r.bytes
    return out
