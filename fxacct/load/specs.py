"""The specs a request names by string: the loss (--loss, --loss-output), the optimizer
(--optimizer, --optim-arg) and --shard over --world-size, each checked here before any trace.
What they do is traced elsewhere: fxacct.trace.loss, fxacct.trace.optim_step, fxacct.memory.sharding."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from fxacct.errors import UsageError
from fxacct.load.flags import CROSS_ENTROPY, LOSSES, MODEL, MSE, SUM, split_assignment  # noqa: F401  (re-exported)
from fxacct.load.model_spec import resolve


@dataclass(frozen=True)
class LossSpec:
    kind: str = SUM
    output: int | None = None  # --loss-output: an index into the floating outputs
    causal: bool = False  # next-token targets (a Hugging Face causal LM)

    def __post_init__(self):
        if self.kind not in LOSSES:
            raise UsageError(f"--loss {self.kind!r} is not a loss fxacct knows: use one of {', '.join(LOSSES)}")

    @property
    def needs_target(self) -> bool:
        return self.kind in (CROSS_ENTROPY, MSE)



OPTIMIZERS = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop, "adadelta": torch.optim.Adadelta,
    "adamax": torch.optim.Adamax, "nadam": torch.optim.NAdam, "radam": torch.optim.RAdam,
    "asgd": torch.optim.ASGD, "rprop": torch.optim.Rprop,
}
NONE = "none"


def parse_optim_arg(text: str) -> tuple[str, object]:
    """'momentum=0.9' -> ('momentum', 0.9); optimizer options must be Python literals."""
    key, raw, value = split_assignment(text, "--optim-arg", "momentum=0.9")
    if value is raw:  # not a literal: optimizers take numbers, booleans and tuples, never bare words
        raise UsageError(f"--optim-arg {text!r}: {raw!r} is not a Python literal "
                         "(write numbers, True/False, or tuples such as betas=(0.9,0.95))")
    return key, value


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "adamw"  # a key of OPTIMIZERS, "none", or "PATH.py:Name"
    args: dict = field(default_factory=dict)
    zero1: bool = False  # wrapped in ZeroRedundancyOptimizer: this rank steps and keeps state for its partition

    @property
    def per_parameter(self) -> bool:
        """A built-in optimizer in its single-tensor implementation: each parameter is updated on
        its own (torch/optim/*.py, _single_tensor_*), so one parameter per shape stands for all."""
        return (self.name.lower() in OPTIMIZERS and not self.zero1 and not self.args.get("foreach")
                and not self.args.get("fused") and not self.args.get("differentiable"))

    def resolve(self):
        """The optimizer class, or None for "none"."""
        key = self.name.lower()
        if key == NONE:
            if self.args:  # options of no optimizer change nothing
                raise UsageError(f"--optim-arg {', '.join(self.args)} with --optimizer none: there is no optimizer "
                                 "to take it; drop --optim-arg or name an optimizer")
            return None
        if key in OPTIMIZERS:
            cls = OPTIMIZERS[key]
        elif ":" in self.name:
            cls, _ = resolve(self.name, torch.optim.Optimizer, "--optimizer")
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                raise UsageError(f"{self.name} is not a torch.optim.Optimizer subclass")
        else:
            raise UsageError(f"unknown optimizer {self.name!r}: use one of {', '.join(sorted(OPTIMIZERS))}, "
                             "none, or PATH.py:Name for your own torch.optim.Optimizer class")
        accepted = inspect.signature(cls.__init__).parameters
        unknown = [k for k in self.args if k not in accepted]
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
            raise UsageError(f"--optim-arg {', '.join(unknown)}: {cls.__name__} takes "
                             f"{', '.join(k for k in accepted if k not in ('self', 'params'))}")
        return cls

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        cls = self.resolve()
        if cls is None or not params:
            return None
        try:
            if self.zero1:  # torch's ZeRO-1 over the default process group (the dp ranks)
                from torch.distributed.optim import ZeroRedundancyOptimizer

                return ZeroRedundancyOptimizer(params, optimizer_class=cls, **self.args)
            return cls(params, **self.args)
        except Exception as e:  # the options are what the user gave: a usage error, not the model's
            raise UsageError(f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in self.args.items())}) "
                             f"rejected its options: {e}") from None


SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp")


def check(shard: str, world_size: int) -> None:
    if shard not in SHARDS:
        raise UsageError(f"unknown --shard {shard!r}: use one of {', '.join(SHARDS)}")
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    if shard != "none" and world_size == 1:
        raise UsageError(f"--shard {shard} partitions state across ranks: give --world-size N with N > 1")
