"""The op-cost registry: one formula per aten overload (or overload packet), pure functions of
shapes. Importing this package fills the registry from every family module.

Public: ``register(op)`` (a decorator: a formula for a user's own op, docs/guide.md "Custom ops"),
``Flops`` (what a formula returns) and ``CostContext`` (what it receives as ``ctx``)."""

from fxacct.costs import attention, fused_optim, losses, matmul, movement, norms, pointwise, resample, rnn, spectral  # noqa: F401  (they register)
from fxacct.costs.registry import CostContext, Flops, OpInfo, lookup, register  # noqa: F401
