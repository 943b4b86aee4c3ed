"""The memory account of one profile: bytes by category × dtype, peaks, per-rank figures,
checkpoint size, views vs copies. Frozen values only; report renders them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxacct.account.accounting import Accounting
from fxacct.costs.registry import numel
from fxacct.dtypes import dtype_name
from fxacct.memory.peak import Peak
from fxacct.memory.reserved import ReservedAccount
from fxacct.trace import torch_private as tp
from fxacct.trace.capture import Capture
from fxacct.trace.records import itemsize


@dataclass(frozen=True)
class DtypeMemory:
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    master_bytes: int = 0
    activation_bytes: int = 0


@dataclass(frozen=True)
class ViewSummary:
    view_nodes: int
    bytes_avoided: int  # what the views' outputs would have cost as copies
    copies: tuple[tuple[str, int, int], ...]  # (op, nodes, new bytes), largest first


@dataclass(frozen=True)
class Fit:
    gpu: str
    capacity_bytes: int  # driver-reported
    peak_bytes: int  # per rank
    headroom_bytes: int  # negative: shortfall
    max_batch: int | None  # largest batch whose per-rank peak fits (None: not searched)
    max_batch_verified: bool
    basis: str = "peak_train_bytes"  # what peak_bytes is: "peak_reserved_bytes + fixed" on a CUDA target

    @classmethod
    def on(cls, device, peak: int, max_batch: int | None = None, verified: bool = False,
           basis: str = "peak_train_bytes") -> Fit:
        """``peak`` bytes per rank on ``device`` (fxacct.devices), against the capacity
        its driver reports."""
        capacity = device.capacity_reported
        return cls(device.name, capacity, peak, capacity - peak, max_batch, verified, basis)


@dataclass(frozen=True)
class MemoryAccount:
    by_dtype: dict  # dtype name -> DtypeMemory
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    master_bytes: int
    activation_bytes: int
    peak_train: Peak | None
    peak_inference: Peak | None
    per_rank: Peak | None  # the training peak on one rank under --shard (None without sharding)
    gathered_unit: tuple[str, int] | None  # ZeRO-3/FSDP: the largest unit gathered at once
    checkpoint_by_dtype: dict  # dtype name -> bytes of tensor payload torch.save writes
    views: ViewSummary
    optimizer_scalars: tuple[int, int] = (0, 0)  # (count, bytes) of 0-dim state (step counts)
    fit: Fit | None = None
    reserved: ReservedAccount | None = None  # the training step through the CUDA caching allocator (with --gpu)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(self.checkpoint_by_dtype.values())

    @property
    def rank_peak(self) -> Peak | None:
        return self.per_rank or self.peak_train

    @property
    def fit_bytes(self) -> int | None:
        """What one rank needs of the GPU: reserved at its peak plus the fixed costs outside the
        allocator where the allocator was replayed (a CUDA target), else the op-level peak; for a
        model of which nothing trains (no backward, no training peak), its inference peak."""
        if self.reserved is not None:
            return self.reserved.fit_bytes
        peak = self.rank_peak or self.peak_inference
        return peak.bytes if peak is not None else None

    @property
    def fit_basis(self) -> str:
        if self.reserved is not None:
            return "peak_reserved_bytes + fixed"
        return "peak_train_bytes" if self.rank_peak is not None else "peak_inference_bytes"


def view_summary(accounting: Accounting, capture: Capture) -> ViewSummary:
    views, avoided, copies = 0, 0, {}
    for row in accounting.nodes:
        if row.kind == "view":
            views += 1
            if row.dtype is not None:
                avoided += numel(row.shape) * itemsize(getattr(torch, row.dtype))
        elif row.kind == "copy":
            n, b = copies.get(row.op, (0, 0))
            copies[row.op] = (n + 1, b + row.output_bytes)
    ordered = tuple(sorted(((op, n, b) for op, (n, b) in copies.items()), key=lambda x: -x[2]))
    return ViewSummary(views, avoided, ordered)


def checkpoint_payload(model: torch.nn.Module, dtype: torch.dtype | None, capture: Capture) -> dict:
    """Tensor bytes of torch.save(model.state_dict()) + torch.save(optimizer.state_dict()), by
    dtype: each storage once (tied weights share one), non-persistent buffers excluded (they are
    not in state_dict). The zip/pickle framing (a few hundred bytes per tensor) is not included.
    Under --mesh, what the rank holds, as its optimizer state is: a DTensor's local shard (a
    replicated one whole, on every rank), as torch.distributed.checkpoint writes it per rank."""
    out: dict[str, int] = {}
    seen = set()
    for t in model.state_dict(keep_vars=True).values():
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        t = tp.local(t)
        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
        out[dtype_name(dt)] = out.get(dtype_name(dt), 0) + t.numel() * itemsize(dt)
    for state in capture.optimizer_state:
        out[dtype_name(state.dtype)] = out.get(dtype_name(state.dtype), 0) + state.nbytes * state.count
    return dict(sorted(out.items()))


def by_dtype(capture: Capture, accounting: Accounting) -> dict:
    table: dict[str, dict[str, int]] = {}

    def add(dt, field, nbytes):
        row = table.setdefault(dtype_name(dt) if isinstance(dt, torch.dtype) else dt, {})
        row[field] = row.get(field, 0) + nbytes

    for p in capture.params:
        nbytes = numel(p.shape) * itemsize(p.dtype)
        add(p.dtype, "param_bytes", nbytes)
        if p.got_grad:
            add(p.dtype, "grad_bytes", nbytes)
    for state in capture.optimizer_state:
        add(state.dtype, "optimizer_bytes", state.nbytes * state.count)
    for _, nbytes, count in capture.master_weights:
        add(torch.float32, "master_bytes", nbytes * count)
    for dt, nbytes in accounting.activation_by_dtype.items():
        if nbytes:
            add(dt, "activation_bytes", nbytes)
    return {k: DtypeMemory(**v) for k, v in sorted(table.items())}


def assemble(capture: Capture, accounting: Accounting, model: torch.nn.Module, dtype: torch.dtype | None,
             peak_train: Peak | None, peak_inference: Peak, per_rank=None, gathered_unit=None,
             reserved: ReservedAccount | None = None) -> MemoryAccount:
    """The memory account of one traced step (a single device's, or one rank's under --mesh)."""
    state = capture.optimizer_state
    return MemoryAccount(
        by_dtype=by_dtype(capture, accounting),
        param_bytes=accounting.totals.param_bytes, grad_bytes=accounting.totals.grad_bytes,
        optimizer_bytes=sum(s.nbytes * s.count for s in state),
        master_bytes=sum(b * c for _, b, c in capture.master_weights),
        activation_bytes=accounting.totals.activation_bytes,
        peak_train=peak_train if capture.has_backward else None, peak_inference=peak_inference,
        per_rank=per_rank, gathered_unit=gathered_unit,
        checkpoint_by_dtype=checkpoint_payload(model, dtype, capture),
        views=view_summary(accounting, capture),
        optimizer_scalars=(sum(s.count for s in state if s.scalar), sum(s.nbytes * s.count for s in state if s.scalar)),
        reserved=reserved,
    )
