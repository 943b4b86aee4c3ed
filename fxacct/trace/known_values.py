"""Known values: the few small tensors whose values an eager run would know, carried beside
their fake tensors so a check on them takes the branch eager takes.

Fake tensors have shapes, not values, so ``if (x == 0).all():`` raises on them. Most such checks
in model code look at tensors the code itself made from sizes alone: ``torch.arange(T)`` position
ids, a mask of ones, their differences and cumulative sums. Those values do not depend on the
weights or on the user's data, so the eager run with any inputs computes the same ones. This
dispatch mode keeps, for every tensor made by a deterministic op whose tensor arguments all have
known values (a factory op has none), a real copy of the value when it is small
(``MAX_NUMEL`` elements), and answers ``aten._local_scalar_dense`` (``bool()``, ``.item()``) from
it. Anything touched by a parameter, an input or a random op stays unknown, and a check on it
raises as before (fxacct.trace.capture reports a data-dependent forward).

The real computation runs past every mode (no record, no fake tensor); it costs a Python check
per op and real work only on the tiny known tensors. An in-place op with an unknown argument makes
what it writes unknown, through every view (its values' storage is marked stale). A real CPU
tensor the code passes in (a constant) is its own value.
"""

from __future__ import annotations

import torch

from fxacct.errors import acts_for_torch, passes_through
from fxacct.trace import torch_private as tp
from fxacct.trace.aliasing import INPLACE, schema_kind

VALUE = "_fxacct_known_value"
# the largest value kept: a [B, T] table of position ids and their differences and cumulative sums
# (Hugging Face's packed-sequence check, masking_utils.find_packed_sequence_indices) for up to 1M
# tokens, 8 MiB in int64. Below it the trace takes eager's branch at any batch a GPU's largest-batch
# search reaches on a small model (the tiny Qwen2 of bench/speed.py: 3,776 x 128 tokens); above it
# such a check is unknown and the model's own fallback (a materialized mask) is traced instead
MAX_NUMEL = 1 << 20
_SCALAR = torch.ops.aten._local_scalar_dense.default
_EMBEDDING = torch.ops.aten.embedding.default
_NO_VALUE = object()


_STALE: set[int] = set()  # storages of values an in-place op overwrote with unknown ones


def known(t) -> torch.Tensor | None:
    """The real value behind fake tensor ``t``, or None when an eager run's value is unknown."""
    value = getattr(t, VALUE, None)
    if value is not None and _STALE and tp.storage_key(value) in _STALE:
        return None
    return value


def _value_of(leaf):
    """A tensor argument's value: a fake one's known value; a real CPU tensor (a constant the code
    made outside the fake mode, such as the 0 of ``x[i] = 0``) is its own value."""
    if isinstance(leaf, tp.FakeTensor):
        return known(leaf)
    return None if leaf.device.type == "meta" or leaf.numel() > MAX_NUMEL else leaf


def _seeded(func) -> bool:
    """Random or uninitialised outputs: their values are no one's to know."""
    return torch.Tag.nondeterministic_seeded in func.tags or "empty" in func.__name__


class KnownValues(tp.TorchDispatchMode):
    """Carries the known values (module docstring); stack it above the fake-tensor mode. With
    ``scalars_only`` (an optimizer's step: its bookkeeping scalars, ASGD's ``mu``) values are kept
    for one-element tensors alone, never a real copy of a state tensor built from a size
    (``torch.zeros(p.shape)``), and a read of a scalar goes down the stack first, answered from its
    known value only where the fake mode cannot: the reads it answers stay recorded ops (an
    optimizer's ``step.item()``, one op per parameter in eager too)."""

    def __init__(self, scalars_only: bool = False):
        super().__init__()
        self.scalars_only = scalars_only

    def __exit__(self, *exc):
        _STALE.clear()
        return super().__exit__(*exc)

    @passes_through
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SCALAR:
            value = known(args[0])
            if value is not None and self.scalars_only:
                try:
                    return func(*args, **kwargs)
                except tp.DataDependentOutputException:
                    pass
            if value is not None:
                with tp.disable_current_modes():
                    return value.item()
        if func is _EMBEDDING:
            _check_rows(args[0], args[1])
        out = func(*args, **kwargs)
        real = _real_arguments((args, kwargs))
        attached = real is not _NO_VALUE and not _seeded(func) and _attach(func, real, out,
                                                                            1 if self.scalars_only else MAX_NUMEL)
        if not attached and schema_kind(func) == INPLACE:
            _forget(args, kwargs)
        return out


@acts_for_torch  # the bounds check eager's kernel makes: its error is the model's, at its line
def _check_rows(weight, indices) -> None:
    """An embedding lookup of known indices past the table (learned positions ``arange(T)`` with T
    above the model's maximum): eager raises there, with this message; fake tensors would not."""
    value = known(indices) if isinstance(indices, tp.FakeTensor) else None
    if value is None or not value.numel():
        return
    with tp.disable_current_modes():  # the real value, past the fake mode
        low, high = int(value.min()), int(value.max())
    if high >= weight.shape[0] or low < 0:
        raise IndexError(f"index out of range in self (an embedding of {weight.shape[0]} rows looked up at "
                         f"{high if high >= weight.shape[0] else low})")


def _real_arguments(tree):
    """``tree`` with each tensor replaced by its known value; _NO_VALUE if one has none."""
    if _unknown_in(tree):  # most ops (a parameter, an activation): answered without flattening
        return _NO_VALUE
    leaves, spec = tp.tree_flatten(tree)
    values = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = _value_of(leaf)
            if leaf is None:
                return _NO_VALUE
        values.append(leaf)
    return tp.tree_unflatten(values, spec)


def _unknown_in(tree) -> bool:
    """Whether a tensor in an op's (args, kwargs) has no known value: tensors, their tuples,
    lists and dicts, as an op's schema passes them."""
    if isinstance(tree, torch.Tensor):
        return _value_of(tree) is None
    if isinstance(tree, (tuple, list)):
        for item in tree:
            if _unknown_in(item):
                return True
    elif isinstance(tree, dict):
        for item in tree.values():
            if _unknown_in(item):
                return True
    return False


def _attach(func, real, out, max_numel: int) -> bool:
    """Compute the outputs' values for real; False where they stay unknown. An in-place op that
    returns nothing (``torch._foreach_add_`` on an optimizer's step counts) runs for real on its
    arguments' values, which it updates as it updates the fakes; no other op that returns nothing
    runs twice (a profiler's record-function exit has effects of its own)."""
    if out is None and tp.returns_nothing(func) and schema_kind(func) == INPLACE:
        args, kwargs = real
        try:
            with tp.disable_current_modes():
                func(*args, **kwargs)
        except Exception:  # noqa: BLE001  as below: what it wrote stays unknown
            return False
        return True
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, torch.Tensor) and o.numel() <= max_numel for o in outs):
        return False
    args, kwargs = real
    try:
        with tp.disable_current_modes():
            values = func(*args, **kwargs)
    except Exception:  # noqa: BLE001  a value eager would know but this kernel cannot give: stays unknown
        return False
    values = values if isinstance(values, (tuple, list)) else (values,)
    if len(values) != len(outs) or not all(
            isinstance(v, torch.Tensor) and v.shape == o.shape and v.device.type != "meta"
            for o, v in zip(outs, values)):
        return False
    for o, v in zip(outs, values):
        setattr(o, VALUE, v)
    return True


def _forget(args, kwargs) -> None:
    """An in-place op with an unknown argument: what it wrote is unknown, in every view of it."""
    for leaf in tp.tree_leaves((args, kwargs)):
        value = known(leaf) if isinstance(leaf, tp.FakeTensor) else None
        if value is not None:
            _STALE.add(tp.storage_key(value))
