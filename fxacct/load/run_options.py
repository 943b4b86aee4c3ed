"""The options of a real run (``--runtime``; fxacct.runtime runs it), beside the Config of the
account it is compared with: a frozen value that needs no torch, so the CLI shows its defaults and
refuses a bad flag before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeOptions:
    device: str = "auto"  # "auto" (CUDA if present, else CPU), "cpu", "cuda", "cuda:N"
    steps: int = 10  # timed steps
    warmup: int = 3
    inference: bool = False
    force: bool = False  # run even when the predicted peak exceeds free memory
    keep_trace: bool = False  # keep the profiler's Chrome trace events (for --trace)


__all__ = ["RuntimeOptions"]
