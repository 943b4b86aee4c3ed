"""The op-cost registry: one formula per aten overload (or overload packet), pure functions of
shapes. Importing this package fills the registry from every family module."""

from fxacct.costs.registry import CostContext, Flops, OpInfo, lookup  # noqa: F401
from fxacct.costs import matmul, attention, pointwise, norms, losses, movement, rnn  # noqa: F401  (they register)
