"""The op-level memory oracle: live tensor-storage bytes during a real eager run, op by op.

DESIGN.md defines ``peak_train_bytes`` and ``peak_inference_bytes`` as what a dispatch-level
storage tracker observes; this is that tracker. It runs on real tensors (CPU or CUDA) and is
independent of fxacct's graph and liveness code, so tests can hold the predicted peaks against it.

    >>> with StorageTracker() as t:
    ...     t.track(model, optimizer, x)        # what exists before the step
    ...     loss = model(x).float().sum(); loss.backward(); optimizer.step()
    >>> t.peak_bytes, t.peak_op, t.live_bytes

What it counts. ``live_bytes`` is the sum of ``nbytes()`` over the *storages* (not tensors: views
share one) that are alive and that the tracker knows of. It learns of a storage

- through ``track()``: parameters, buffers and their ``.grad`` of a module, every tensor in an
  optimizer's ``state`` and ``param_groups``, or any tensor in a (nested) list/tuple/dict;
- as an output of an aten op run inside the mode: the newly allocated storages of every op, and
  a known storage whose size an op changed (``resize_``, ``out=`` arguments) by the difference;
- as an input of an aten op inside the mode (looked at before the op runs), if it was neither
  tracked nor produced by an op before: a tensor ``track()`` missed, or one made without the
  dispatcher (``from_numpy``). It counts from that op on, and its bytes are summed in
  ``adopted_bytes``, so a caller can check it forgot nothing (0 when everything was tracked).
  The fresh tensor that ``torch.tensor(...)`` hands to ``aten.lift_fresh`` counts as that op's
  allocation instead.

A storage leaves the count when it is freed (a ``weakref`` callback on the storage object, which
PyTorch keeps alive exactly as the storage). The callback subtracts once, also when it
fires after the mode has exited: then it lowers ``live_bytes`` and leaves the peak alone.

``peak_bytes`` is the largest ``live_bytes`` seen right after an op's outputs were counted (the
op's inputs, still referenced, are live then too) or right after a ``track()`` call; ``peak_op``
names that op (``"aten.mm.default"``), or is None when the peak was reached by ``track()``.

What it does not see (an aten-op-level figure, not the allocator's):

- memory a kernel allocates and frees inside itself: oneDNN/MKL scratch and weight reorders,
  RNN workspaces, cuBLAS/cuDNN workspaces, and the outputs of the aten ops a kernel calls
  internally (they run below the dispatch mode);
- allocator effects: CUDA's 512-byte rounding, caching, fragmentation; a CUDA figure is the
  logical bytes of the storages, summed over all devices;
- a Python number in a tensor op (``x * 2.0``): PyTorch wraps it in a 0-dim tensor that autograd
  may save, but the mode is shown a Python number;
- storages on the meta device, which includes every FakeTensor;
- tensors without a plain storage: sparse, MKLDNN and other non-strided layouts (wrapper
  subclasses that flatten into plain tensors, such as DTensor, are counted through their parts);
- ``UntypedStorage.resize_`` called directly (not an aten op) until the next op that touches it;
- when a storage in a reference cycle dies: it counts until Python's cyclic GC frees it
  (``measure_*`` below hold the GC off while they measure, so it counts to the step's end).
"""

from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass

import torch

from fxacct.trace.loss import training_loss
from fxacct.trace.torch_private import TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves

aten = torch.ops.aten

# Ops whose tensor input is a fresh tensor built outside the dispatcher (torch.tensor(...)):
# their output is the allocation, not an adopted pre-existing storage.
_FRESH_INPUT_OPS = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default})


def _storages(obj):
    """The real (non-meta) untyped storages of every tensor in obj, views included."""
    stack = [x for x in tree_leaves(obj) if isinstance(x, torch.Tensor)]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            stack.extend(a for a in (getattr(t, n) for n in attrs) if isinstance(a, torch.Tensor))
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, mkldnn: no plain storage
            continue
        if st.device.type != "meta":
            yield st


class _Entry:
    __slots__ = ("ref", "nbytes")

    def __init__(self, ref: weakref.ref, nbytes: int):
        self.ref = ref
        self.nbytes = nbytes


class StorageTracker(TorchDispatchMode):
    """Live and peak storage bytes of a real eager run, at aten-op granularity (module docstring)."""

    def __init__(self):
        super().__init__()
        self._lock = threading.RLock()  # autograd may run CUDA backward ops on its own threads
        self._entries: dict[int, _Entry] = {}  # id(storage object) -> entry
        self._live = 0
        self._peak = 0
        self._peak_op: str | None = None
        self._adopted = 0

    @property
    def live_bytes(self) -> int:
        return self._live

    @property
    def peak_bytes(self) -> int:
        return self._peak

    @property
    def peak_op(self) -> str | None:
        return self._peak_op

    @property
    def adopted_bytes(self) -> int:
        """Bytes of storages first met as an op's input: neither tracked nor made by an op."""
        return self._adopted

    def track(self, *objs) -> StorageTracker:
        """Count what already exists: modules (parameters, buffers, their .grad), optimizers
        (every tensor in state and param_groups), tensors, and lists/tuples/dicts of these."""
        tensors = []
        stack = list(objs)
        while stack:
            obj = stack.pop()
            if isinstance(obj, torch.nn.Module):
                params = list(obj.parameters())
                tensors += params + [p.grad for p in params if p.grad is not None]
                tensors += list(obj.buffers())
            elif isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    stack += list(group.values())
                stack += [p.grad for g in obj.param_groups for p in g["params"] if p.grad is not None]
                stack += list(obj.state.values())
            elif isinstance(obj, torch.Tensor):
                tensors.append(obj)
            elif isinstance(obj, (list, tuple)):
                stack += list(obj)
            elif isinstance(obj, dict):
                stack += list(obj.values())
        with self._lock:
            for st in _storages(tensors):
                self._see(st)
            self._note_peak(None)
        return self

    def reset_peak(self) -> None:
        """Start a new peak from the current live bytes (e.g. to measure one phase)."""
        with self._lock:
            self._peak, self._peak_op = self._live, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _FRESH_INPUT_OPS:  # before the op: an out= argument it resizes is its output
            with self._lock:
                for st in _storages((args, kwargs)):
                    self._adopted += self._see(st)
        out = func(*args, **(kwargs or {}))
        with self._lock:
            for st in _storages(out):
                self._see(st)
            self._note_peak(func)
        return out

    def _see(self, st: torch.UntypedStorage) -> int:
        """Count st if new, or its size change if known; return the bytes added for a new one."""
        nbytes = st.nbytes()
        key = id(st)
        entry = self._entries.get(key)
        if entry is not None and entry.ref() is st:
            self._live += nbytes - entry.nbytes
            entry.nbytes = nbytes
            return 0
        if entry is not None:  # a dead storage whose callback has not run: retire it here
            self._live -= entry.nbytes
            del self._entries[key]
        if nbytes == 0:  # nothing to count; a later resize makes it new then
            return 0
        ref = weakref.ref(st, lambda r, key=key: self._freed(key, r))
        self._entries[key] = _Entry(ref, nbytes)
        self._live += nbytes
        return nbytes

    def _freed(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.ref is not ref:  # already retired: subtract once only
                return
            del self._entries[key]
            self._live -= entry.nbytes

    def _note_peak(self, func) -> None:
        if self._live > self._peak:
            self._peak = self._live
            self._peak_op = None if func is None else str(func)


@dataclass(frozen=True)
class TrackedStep:
    """One measured step. ``baseline_bytes``: parameters, buffers, gradients, optimizer state and
    inputs live when it began; ``adopted_bytes``: see ``StorageTracker.adopted_bytes``."""

    peak_bytes: int
    peak_op: str | None
    baseline_bytes: int
    adopted_bytes: int = 0


def default_loss(output) -> torch.Tensor:
    """DESIGN.md's loss: the sum over floating outputs (pytree order) of ``t.float().sum()``."""
    return training_loss(output)


def _as_args(inputs) -> tuple:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def measure_training_step(model: torch.nn.Module, inputs, optimizer_factory, loss_fn=None, *,
                          kwargs=None) -> TrackedStep:
    """Peak storage bytes of one steady-state training step of ``model(*inputs, **kwargs)``.

    ``optimizer_factory`` gets the parameters with ``requires_grad=True`` (``torch.optim.AdamW``
    or ``lambda ps: torch.optim.SGD(ps, lr=0.1)``). One warm-up step runs first, untracked, so the
    optimizer state exists (it updates the model's parameters); then ``zero_grad(set_to_none=True)``
    and the measured step: forward, loss, backward, ``optimizer.step()``, the loss held to the end
    as a training loop's variable holds it. The model's output lives until the loss is built, as
    in the step fxacct accounts. The model's
    train/eval mode is left as the caller set it.
    """
    args, kwargs = _as_args(inputs), dict(kwargs or {})
    loss_fn = loss_fn or default_loss
    optimizer = optimizer_factory([p for p in model.parameters() if p.requires_grad])

    def step():
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        return loss

    step()
    optimizer.zero_grad(set_to_none=True)
    with _gc_paused(), StorageTracker() as tracker:
        baseline = tracker.track(model, optimizer, args, kwargs).live_bytes
        step()
    return TrackedStep(tracker.peak_bytes, tracker.peak_op, baseline, tracker.adopted_bytes)


def measure_inference(model: torch.nn.Module, inputs, *, kwargs=None) -> TrackedStep:
    """Peak storage bytes of ``model(*inputs, **kwargs)`` under ``model.eval()`` and
    ``torch.no_grad()``; the model's training flag is restored afterwards."""
    args, kwargs = _as_args(inputs), dict(kwargs or {})
    was_training = model.training
    model.eval()
    try:
        with _gc_paused(), torch.no_grad(), StorageTracker() as tracker:
            baseline = tracker.track(model, args, kwargs).live_bytes
            model(*args, **kwargs)
    finally:
        model.train(was_training)
    return TrackedStep(tracker.peak_bytes, tracker.peak_op, baseline, tracker.adopted_bytes)


class _gc_paused:
    """Hold Python's cyclic GC off, so storages in reference cycles die at a fixed point."""

    def __enter__(self):
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()

    def __exit__(self, *exc):
        if self._was_enabled:
            gc.enable()


__all__ = ["StorageTracker", "TrackedStep", "default_loss", "measure_training_step",
           "measure_inference"]
