"""One call from a model (or a "PATH.py:Name" target) to its Accounting: load → capture →
annotate → account. No formatting here (fxacct.report) and no flags (the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fxacct import load as loading
from fxacct.accounting import Accounting, account
from fxacct.annotate import annotate
from fxacct.capture import Capture, capture
from fxacct.config import Config


@dataclass(frozen=True)
class Profile:
    config: Config
    accounting: Accounting
    capture: Capture


def tokens_per_example(args, kwargs, batch: int) -> int | None:
    """The per-example element count of the first integer input (T for long[B, T])."""
    for t in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool and t.dim() > 0:
            if t.shape[0] == batch:
                return t.numel() // batch
    return None


def profile_module(model: torch.nn.Module, args=(), kwargs=None, config: Config | None = None) -> Profile:
    """Account one training step's forward and backward of ``model(*args, **kwargs)``.

    ``args``/``kwargs`` may be meta tensors (only shapes and dtypes are read); nothing of the
    model's own tensors is allocated or changed."""
    config = config or Config()
    kwargs = kwargs or {}
    cap = capture(model, tuple(args), kwargs, dtype=config.dtype,
                  input_requires_grad=config.input_requires_grad, loss_output=config.loss_output)
    annotate(cap.graph, config.causal_attention)
    tokens = config.tokens_per_example or tokens_per_example(args, kwargs, config.batch)
    return Profile(config, account(cap, config.batch, tokens), cap)


def load_model(config: Config):
    """(model on meta, args, kwargs) for config.target, inputs per DESIGN.md's loading rules."""
    obj, file_module = loading.resolve(config.target)
    name = config.target.rpartition(":")[2]
    model = loading.build(obj, dict(config.kwargs), name)
    if config.inputs:
        args = tuple(s.make(config.batch) for s in config.inputs if s.name is None)
        kwargs = {s.name: s.make(config.batch) for s in config.inputs if s.name is not None}
    else:
        args, kwargs = loading.require_inputs(loading.example_inputs(model, file_module, config.batch))
    return model, args, kwargs


def profile(config: Config) -> Profile:
    """Load config.target and profile it."""
    model, args, kwargs = load_model(config)
    return profile_module(model, args, kwargs, config)


__all__ = ["Profile", "profile", "profile_module", "load_model", "replace"]
