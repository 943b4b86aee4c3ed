"""The registry and the values it holds.

One way in: ``@register(aten.mm)`` (a packet covers all its overloads) or ``@register(aten.add.Tensor)``
(one overload). A second registration of the same key raises. Lookup tries the overload, then its
packet, then the families keyed by torch's op tags (pointwise, reduction); what is still unknown
is counted and reported, never taken as zero.

A formula receives the op's arguments with every tensor replaced by its shape (a tuple), the
output shape(s) as ``out_shape``, and a ``CostContext``; it returns ``Flops``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fxacct.trace.frozen_init import fast_init
from fxacct.trace.torch_private import OpOverload, OpOverloadPacket, schema_arguments

MATMUL, ATTENTION, OTHER = "matmul", "attention", "other"
FLOP_CLASSES = (MATMUL, ATTENTION, OTHER)


@fast_init
@dataclass(frozen=True, slots=True)
class Flops:
    """FLOPs of one op by class (DESIGN.md): matmul = 2·m·n·p of mm/bmm/conv only; attention =
    every fused attention kernel as its math path; other = pointwise, reductions, norms, softmax."""

    matmul: int = 0
    attention: int = 0
    other: int = 0

    def __add__(self, o: Flops) -> Flops:
        return Flops(self.matmul + o.matmul, self.attention + o.attention, self.other + o.other)

    @property
    def total(self) -> int:
        return self.matmul + self.attention + self.other

    def as_dict(self) -> dict[str, int]:
        return {MATMUL: self.matmul, ATTENTION: self.attention, OTHER: self.other}


ZERO = Flops()


@dataclass(frozen=True)
class CostContext:
    """What a formula may need beyond shapes.

    causal_attention: "full" counts every (query, key) pair; "halved" counts half of them for
    causal kernels (the upper triangle is masked). grad_mask: for the backward of a fused kernel,
    which of its forward tensor inputs need a gradient (None when unknown: all of them)."""

    causal_attention: str = "full"
    grad_mask: tuple[bool, ...] | None = None
    op: object = None  # the OpOverload being costed, for formulas that read arguments by name


@dataclass(frozen=True)
class OpInfo:
    """A registry entry. ``movement``: allocates and copies bytes, costs 0 FLOPs (cat, clone,
    _to_copy...); ``creation``: makes a tensor from nothing but sizes (zeros, arange...)."""

    formula: Callable[..., Flops]
    movement: bool = False
    creation: bool = False
    wants_grad_mask: bool = False
    source: str | None = None  # the --costs file that registered it (a user's formula), None for fxacct's


_REGISTRY: dict[object, OpInfo] = {}
_SOURCE: list[str] = []  # the --costs file being imported (fxacct.costs.user.load_costs), if any


@contextlib.contextmanager
def registering_from(path: str):
    """The formulas registered meanwhile are the user's, from ``path`` (OpInfo.source)."""
    _SOURCE.append(path)
    try:
        yield
    finally:
        _SOURCE.pop()
FOREACH = "foreach"  # registry key of the _foreach_* family (multi-tensor optimizer ops)
# the random numbers of a compiled graph's dropout (torch/_inductor/inductor_prims.py): its seeds,
# the one each use looks up, the draws. They exist only once torch._inductor is imported (seconds),
# so they are keyed by their qualified name (fxacct.costs.movement registers them)
INDUCTOR_RANDOM = ("prims::inductor_seeds", "prims::inductor_lookup_seed", "prims::inductor_random",
                   "prims::inductor_randint")


def register(*ops, movement: bool = False, creation: bool = False, wants_grad_mask: bool = False):
    """Decorator: ``formula`` is the cost of each of ``ops`` (an OpOverload such as
    torch.ops.mylib.op.default, or an OpOverloadPacket such as torch.ops.mylib.op for all its
    overloads). Public (fxacct.costs.register): a user's custom op gets a formula the same way."""
    for op in ops:
        if not isinstance(op, (OpOverload, OpOverloadPacket, torch.Tag)) and op != FOREACH and op not in INDUCTOR_RANDOM:
            raise ValueError(f"register takes torch.ops.NAMESPACE.OP[.OVERLOAD], got {op!r}")

    def wrap(formula):
        for op in ops:
            if op in _REGISTRY:
                raise ValueError(f"{op} already has a cost formula")
            _REGISTRY[op] = OpInfo(formula, movement, creation, wants_grad_mask, _SOURCE[-1] if _SOURCE else None)
        return formula

    return wrap


def register_zero(*ops, movement: bool = False, creation: bool = False):
    """Ops that do no arithmetic: data movement (bytes, no FLOPs) or tensor creation."""

    def zero(*args, **kwargs) -> Flops:
        return ZERO

    register(*ops, movement=movement, creation=creation)(zero)


def lookup(op) -> OpInfo | None:
    """The entry for an OpOverload: its own, its packet's, or its tag family's; None if unknown."""
    info = _REGISTRY.get(op)
    if info is None:
        packet = getattr(op, "overloadpacket", None)
        info = _REGISTRY.get(packet) or _REGISTRY.get(getattr(packet, "_qualified_op_name", None))
    if info is None:
        tags = getattr(op, "tags", ())
        for tag in (torch.Tag.pointwise, torch.Tag.reduction, torch.Tag.inplace_view):
            if tag in tags:
                return _REGISTRY[tag]
        name = getattr(getattr(op, "overloadpacket", op), "__name__", "")
        if name.startswith("_foreach_"):
            return _REGISTRY.get(FOREACH)
    return info


def argument(op, args, kwargs, name: str, default=None):
    """An op argument by its schema name, whether it was passed by position or keyword."""
    if name in kwargs:
        return kwargs[name]
    for i, (arg_name, kwarg_only) in enumerate(schema_arguments(op)):
        if arg_name == name:
            return args[i] if i < len(args) and not kwarg_only else default
    return default


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
