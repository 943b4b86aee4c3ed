"""The FakeTensorMode fxacct traces in, with a short path for ops that only make metadata.

FakeTensorMode dispatches every op through its cache (a hash of every argument's metadata, then
a rebuilt output) or its general path (subclass, constant and symbolic-shape checks, decomposition
and fake-impl lookups), about 0.1-0.2 ms an op. Views and ``empty`` allocations need none of it:
their output is the meta kernel's, wrapped as a FakeTensor on the input's device (a view) or the
requested one (a new tensor), which is what the general path ends in for them too
(``in_kernel_invocation_manager`` around the kernel, then ``FakeTensor(mode, out, device)``;
torch 2.13 ``fake_tensor.py::_dispatch_impl``, ``fake_impls.py::constructors``). FSDP2's hooks
make thousands of such ops per step under ``--mesh`` (views of all-gather outputs, ``detach``,
``as_strided``, ``empty`` buffers), and ``to_empty`` one ``empty_like`` per parameter (of a meta
tensor: FSDP2's and DTensor's local shards of a model built on meta).

The short path is taken only where the general one could do nothing else: every tensor argument
is a plain FakeTensor of this mode with no constant value behind it, sizes are plain ints (no
shape environment), and no real tensors are propagated. Anything else goes the usual way.
``aten.view`` and ``aten._unsafe_view`` have a Python fake impl in torch (``_view_meta``, the
reference reshape helper, kept for unbacked symbolic sizes); with plain ints the C++ meta kernel
computes the same view, the one eager runs. tests/test_fake_mode.py compares every short-path op
with FakeTensorMode's own result.

Ops outside aten/prims (FSDP2's ``fsdp.*`` copies, the ``c10d.*`` collectives) are ones torch never
caches; they skip the cache key torch would compute only to bypass it, and the ones that return
nothing and write only into their ``out`` tensors run their kernel once per signature
(``FakeTensorMode._uncached``).
"""

from __future__ import annotations

import contextlib

import torch

from fxacct.errors import passes_through
from fxacct.trace import torch_private as tp

aten = torch.ops.aten

# Ops whose output aliases their first argument (schema alias info ``Tensor(a)``) and whose meta
# kernel is the eager one: the output's metadata is all there is to compute.
VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.as_strided.default, aten.detach.default,
    aten.alias.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim,
})
# Uninitialized allocations: the tensor is its shape, strides, dtype and device.
NEW = frozenset({aten.empty.memory_format, aten.empty_strided.default})
# Allocations like another tensor: the meta kernel's metadata is what FakeTensorMode's own handler of
# them (fake_impls.py, like_constructors) returns too; the values (zeros, ones) are the known-value
# mode's to keep (fxacct.trace.known_values), above this one. An optimizer's state (zeros_like per
# parameter, Adam's two) takes this path.
LIKE = frozenset({aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default})

# The namespaces whose ops FakeTensorMode may cache (torch._library.utils.is_builtin); the others
# (fsdp.*, c10d.*, _c10d_functional.*, a user's custom ops) it runs uncached every time.
BUILTIN = frozenset({"aten", "prim", "prims"})

_META = torch.device("meta")
_CPU = torch.device("cpu")  # FakeTensorMode's default device for a factory given none


class FakeTensorMode(tp.FakeTensorMode):
    """torch's FakeTensorMode; views and ``empty`` allocations skip its cache and checks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._out_only_done: set = set()  # _out_only_key of calls whose kernel changed nothing

    @passes_through  # a kernel refusing the model's op is the model's error, judged at its line
    def dispatch(self, func, types, args=(), kwargs=None):
        if func in VIEWS or func in NEW or func in LIKE:
            out = self._short(func, args, kwargs or {})
            if out is not None:
                return out
        elif type(func) is tp.OpOverload and func.namespace not in BUILTIN:
            return self._uncached(func, types, args, kwargs or {})
        return super().dispatch(func, types, args, kwargs)

    def _uncached(self, func, types, args, kwargs):
        """An op FakeTensorMode never caches (fsdp.*, c10d.*, a user's custom op): it would hash the
        arguments, then store or find a bypass entry ("non-builtin", ``_validate_cache_key``) and
        run ``_dispatch_impl``; this runs it at once. An op that returns nothing and only writes into
        its ``out`` tensors (FSDP2's ``split_with_sizes_copy`` and ``chunk_cat``, twice per block
        and step) is run once per signature: a fake kernel reads metadata only, so when it left
        every argument's shape, strides, offset and dtype as they were, a call with the same
        signature (aliasing between the arguments included) would too."""
        key = _out_only_key(func, args, kwargs)
        if key is not None and key in self._out_only_done:
            return None
        out = tp.fake_dispatch_uncached(self, func, types, args, kwargs)
        if key is not None and out is None and _out_only_key(func, args, kwargs) == key:
            self._out_only_done.add(key)
        return out

    def serves(self, args=(), like: bool = False) -> bool:
        """Whether the short path may answer an op on ``args``: no shape environment, no real
        tensors propagated, plain arguments (_plain)."""
        return self.shape_env is None and not self.propagate_real_tensors and self._plain(args, like)

    @passes_through
    def _short(self, func, args, kwargs):
        if not self.serves(args, func in LIKE):
            return None
        if func in VIEWS:
            if kwargs:
                return None
            device = args[0].fake_device
        else:
            if kwargs.get("layout") not in (None, torch.strided):
                return None
            device = kwargs.get("device") or (_device(args[0]) if func in LIKE else _CPU)
            kwargs = {**kwargs, "device": _META}
        with tp.in_kernel_invocation_manager(self):
            out = func(*args, **kwargs)
        return tp.FakeTensor(self, out, device)

    def _plain(self, args, like: bool = False) -> bool:
        """Every tensor a FakeTensor of this mode without a constant; every size a plain int. An
        ``empty_like`` reads only its input's metadata: a meta tensor will do as well (``to_empty``
        of a model built on meta: FakeTensorMode would first convert it, for nothing)."""
        for a in args:
            if isinstance(a, torch.Tensor):
                if like and type(a) is torch.Tensor and a.is_meta:
                    continue
                if type(a) is not tp.FakeTensor or a.fake_mode is not self or a.constant is not None:
                    return False
            elif isinstance(a, (list, tuple)):
                if not all(type(x) is int for x in a):
                    return False
            elif not isinstance(a, (int, float, bool, torch.dtype, torch.memory_format, type(None))):
                return False
        return True


def fresh(mode: FakeTensorMode, shape, stride, dtype: torch.dtype) -> torch.Tensor:
    """A new fake tensor of ``mode`` on the CPU: what ``torch.empty_strided`` (``torch.empty`` where
    ``stride`` is None) under the mode returns (its short path above: the meta kernel's output
    wrapped), made below every Python mode. A replayed block makes one per output and gradient
    (about 900 on a 70B step) with the recorder suppressed, a capture one per parameter: the trip
    through the recorder and the fake mode's dispatch costs 3-4x the tensor. Where the short path
    would not serve (another mode, a shape environment, real tensors propagated) the factory is
    dispatched as before, inside ``mode``."""
    if not (isinstance(mode, FakeTensorMode) and mode.serves()):
        with contextlib.nullcontext() if tp.fake_mode_in_force() is mode else mode:
            return dispatched_empty(shape, stride, dtype)
    with tp.no_python_dispatch():
        meta = (torch.empty(shape, dtype=dtype, device=_META) if stride is None
                else torch.empty_strided(shape, stride, dtype=dtype, device=_META))
    return tp.FakeTensor(mode, meta, _CPU)


def dispatched_empty(shape, stride, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty_strided`` (``torch.empty`` where ``stride`` is None) on the CPU, through every
    mode in force: under a fake mode, a fake tensor of it."""
    if stride is None:
        return torch.empty(shape, dtype=dtype, device=_CPU)
    return torch.empty_strided(shape, stride, dtype=dtype, device=_CPU)


def alias(t: torch.Tensor) -> torch.Tensor | None:
    """``aten.detach(t)`` (a new tensor on t's storage) made below every Python mode where t is a
    plain fake tensor of fxacct's mode, whose short path would make it (None elsewhere): the view
    without the dispatch to reach it."""
    mode = t.fake_mode if type(t) is tp.FakeTensor else None
    if not (isinstance(mode, FakeTensorMode) and mode.serves((t,))):
        return None
    with tp.in_kernel_invocation_manager(mode), tp.no_python_dispatch():
        meta = aten.detach.default(t)
    return tp.FakeTensor(mode, meta, t.fake_device)


def _device(t: torch.Tensor) -> torch.device:
    return t.fake_device if type(t) is tp.FakeTensor else t.device


def _out_only_key(func, args, kwargs):
    """The signature of a call of an op that returns nothing: each plain FakeTensor argument's
    shape, strides, storage offset, dtype, device and which earlier argument's storage it shares
    (a kernel may refuse overlapping ones), and every other argument as it is. None when the op
    returns something or an argument is anything else (a subclass, a real tensor, an object)."""
    if not tp.returns_nothing(func):
        return None
    storages: dict = {}
    key: list = [func]
    if not all(_signed(a, key, storages) for a in args) or not all(
            _signed(k, key, storages) and _signed(v, key, storages) for k, v in kwargs.items()):
        return None
    return tuple(key)


def _signed(a, key: list, storages: dict) -> bool:
    """Append argument ``a``'s part of an _out_only_key to ``key``; False if it has none."""
    if type(a) is tp.FakeTensor:
        if a.constant is not None:
            return False
        first = storages.setdefault(tp.storage_key(a), len(storages))
        key.append((tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.fake_device, first))
    elif isinstance(a, (list, tuple)):
        key.append(len(a))
        return all(_signed(x, key, storages) for x in a)
    elif type(a) in _PLAIN:
        key.append(a)
    else:
        return False
    return True


_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format})
