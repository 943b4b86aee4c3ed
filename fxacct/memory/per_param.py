"""Bytes of training state per parameter, from the precision flags and the optimizer, and what one
rank holds of them under ZeRO/FSDP: the arithmetic of `fxacct estimate max-params`.

The parts follow the memory account (fxacct.memory): parameters and gradients in the parameter
dtype (`--dtype`, fp32 when absent; `--amp` keeps fp32 parameters), fp32 master weights with
`--master-weights`, and the optimizer's state. The state is not a hand table: the optimizer class
is stepped once on a small 1-D parameter of the dtype it steps (fp32 masters, else the parameter
dtype) at two sizes, and the state that grows with the parameter gives bytes per element, so any
torch.optim class and option is exact (AdamW: exp_avg + exp_avg_sq; SGD with momentum:
momentum_buffer; RMSprop centered: square_avg + grad_avg). Per-tensor scalars (`step`) do not grow
with the model and are left out. A factored optimizer (Adafactor) stores less for a matrix than
for the 1-D parameter measured here.

Sharding (fxacct.memory.sharding): zero1 partitions the optimizer state and master weights,
zero2 also the gradients, zero3/fsdp also the parameters; a partitioned part costs bytes / N per
rank (Rajbhandari et al. 2020, §5: 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N for mixed-precision Adam).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from fxacct.dtypes import dtype_name
from fxacct.errors import UsageError
from fxacct.load.config import Config
from fxacct.memory.peak import GRADIENTS, MASTER_WEIGHTS, OPTIMIZER_STATE, PARAMETERS
from fxacct.memory.sharding import partitioned
from fxacct.trace.optim_step import OptimizerSpec
from fxacct.trace.records import itemsize
from fxacct.trace.torch_private import FakeTensorMode

# Two sizes of the probe parameter (elements): the state's growth between them is per element.
PROBE_SIZES = (16, 48)


@dataclass(frozen=True)
class Part:
    category: str  # fxacct.memory.peak category: parameters, gradients, master_weights, optimizer_state
    bytes_per_param: Fraction  # unsharded
    ways: int  # ranks it is partitioned across (1: every rank holds it all)
    dtype: str | None  # torch name; None for optimizer state (see `state`)
    state: tuple[tuple[str, str, Fraction], ...] = ()  # optimizer: (state name, dtype, bytes per element)

    @property
    def per_rank(self) -> Fraction:
        return self.bytes_per_param / self.ways


@dataclass(frozen=True)
class BytesPerParam:
    parts: tuple[Part, ...]
    optimizer: str
    precision: str  # "float32", "autocast bfloat16", "bfloat16 + fp32 master weights"
    shard: str
    world_size: int

    @property
    def total(self) -> Fraction:
        return sum((p.bytes_per_param for p in self.parts), Fraction(0))

    @property
    def per_rank(self) -> Fraction:
        return sum((p.per_rank for p in self.parts), Fraction(0))


def _state_after_step(spec: OptimizerSpec, numel: int, dtype: torch.dtype, fake: bool) -> dict[str, tuple[int, torch.dtype]]:
    """{state name: (bytes, dtype)} after one step over one parameter of ``numel`` elements."""
    from contextlib import nullcontext

    with FakeTensorMode() if fake else nullcontext():
        p = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
        p.grad = torch.zeros(numel, dtype=dtype)
        opt = spec.build([p])
        if opt is None:
            return {}
        opt.step()
        return {k: (v.numel() * v.element_size(), v.dtype)
                for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}


def optimizer_state_per_element(spec: OptimizerSpec, dtype: torch.dtype) -> tuple[tuple[str, str, Fraction], ...]:
    """((state name, dtype name, bytes per parameter element), ...) for the state that grows with
    the parameter. Stepped on real tiny CPU tensors (exact, and fine for optimizers that read a
    value with .item(), like ASGD); on fake tensors where CPU kernels lack the dtype (fp8)."""
    small, large = PROBE_SIZES
    errors = []
    for fake in (False, True):
        try:
            a = _state_after_step(spec, small, dtype, fake)
            b = _state_after_step(spec, large, dtype, fake)
            break
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - tried again on fake tensors, reported below
            errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    else:
        raise UsageError(f"optimizer {spec.name} could not be stepped on a {dtype_name(dtype)} parameter "
                         f"({errors[-1]}): pick another --optimizer or --dtype")
    out = []
    for name, (nbytes, dt) in b.items():
        grown = Fraction(nbytes - a.get(name, (0, dt))[0], large - small)
        if grown:
            out.append((name, dtype_name(dt), grown))
    return tuple(out)


def bytes_per_param(config: Config) -> BytesPerParam:
    """The per-parameter training state of ``config``'s precision flags, optimizer and sharding
    (its other fields are unused). Config has validated the flag combinations."""
    param_dtype = config.dtype or torch.float32
    stepped_dtype = torch.float32 if config.master_weights else param_dtype
    ways = partitioned(config.shard, config.world_size)
    size = Fraction(itemsize(param_dtype))
    parts = [Part(PARAMETERS, size, ways.get(PARAMETERS, 1), dtype_name(param_dtype)),
             Part(GRADIENTS, size, ways.get(GRADIENTS, 1), dtype_name(param_dtype))]
    if config.master_weights:
        parts.append(Part(MASTER_WEIGHTS, Fraction(itemsize(torch.float32)), ways.get(MASTER_WEIGHTS, 1),
                          "float32"))
    spec = OptimizerSpec(config.optimizer, dict(config.optim_args))
    state = optimizer_state_per_element(spec, stepped_dtype)
    parts.append(Part(OPTIMIZER_STATE, sum((b for _, _, b in state), Fraction(0)),
                      ways.get(OPTIMIZER_STATE, 1), None, state))
    if config.amp is not None:
        precision = f"autocast {dtype_name(config.amp)}, float32 parameters"
    elif config.master_weights:
        precision = f"{dtype_name(param_dtype)} + float32 master weights"
    else:
        precision = dtype_name(param_dtype)
    return BytesPerParam(tuple(parts), config.optimizer, precision, config.shard, config.world_size)

