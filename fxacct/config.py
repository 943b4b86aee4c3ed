"""The frozen configuration one account is computed for (the CLI's flags, gathered once)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CAUSAL_CONVENTIONS = ("full", "halved")


@dataclass(frozen=True)
class Config:
    target: str | None = None  # "PATH.py:Name", for reports
    batch: int = 1
    kwargs: dict = field(default_factory=dict)  # constructor arguments
    inputs: tuple = ()  # InputSpec; empty: the model's example_inputs(batch)
    dtype: torch.dtype | None = None  # cast parameters, buffers and floating inputs
    input_requires_grad: bool = False
    loss_output: int | None = None
    causal_attention: str = "full"
    tokens_per_example: int | None = None
    optimizer: str = "adamw"
    amp: str | None = None
    gpu: str | None = None
    world_size: int = 1
    shard: str = "none"

    def __post_init__(self):
        from fxacct.errors import UsageError

        if self.batch <= 0:
            raise UsageError(f"--batch must be a positive integer, got {self.batch}")
        if self.causal_attention not in CAUSAL_CONVENTIONS:
            raise UsageError(f"--causal-attention must be one of {', '.join(CAUSAL_CONVENTIONS)}")
        if self.tokens_per_example is not None and self.tokens_per_example <= 0:
            raise UsageError(f"--tokens-per-example must be positive, got {self.tokens_per_example}")
