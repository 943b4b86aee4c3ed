"""The real model and its inputs, built as the account builds them (fxacct.runtime.run measures
them, fxacct.runtime.gloo_run on each rank)."""

from __future__ import annotations

import torch

from fxacct.errors import ModelError, first_line
from fxacct.load import fp8
from fxacct.load import source as sources
from fxacct.load.config import Config
from fxacct.trace import torch_private as tp
from fxacct.trace.checkpointing import wrap
from fxacct.trace.compiled import CompileSpec, compile_in_place

SEED = 0  # the weights' and inputs' random seed


def build_model(config: Config, device: torch.device):
    """(model with random weights on device, its ModelSource): the same model the account traces,
    for every spec form (fxacct.load.source)."""
    source = sources.open_source(config)
    torch.manual_seed(SEED)
    try:
        model = source.build(device)
    except torch.cuda.OutOfMemoryError as e:
        raise ModelError(f"out of memory building {source.name} on {device} ({first_line(e)}); "
                         "use a smaller model or free the device") from e
    fp8.convert(model, config.fp8)  # --fp8: the Float8Linear layers the account traced
    if config.dtype is not None:
        model.to(config.dtype)
    if config.checkpoint:  # --checkpoint: the real run checkpoints the modules the capture did
        wrap(model, config.checkpoint, config.checkpoint_policy)
    if config.compiled:  # --compile, --compile-blocks: compiled by the first (warm-up) step
        compile_in_place(model, CompileSpec(config.compile_blocks, config.compile_mode))
    return model, source


def make_inputs(config: Config, model, source, device: torch.device):
    """(args, kwargs) of real tensors on device: the --input specs, else example_inputs(batch),
    else the spec form's defaults (fxacct.load.source.inputs)."""
    torch.manual_seed(SEED)
    args, kwargs = sources.inputs(source, model, config, config.batch, device)

    def prepare(t):
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device)
        if t.is_floating_point():
            if config.dtype is not None:
                t = t.to(config.dtype)
            if config.input_requires_grad:
                t.requires_grad_(True)
        return t

    args = tp.tree_map(prepare, tuple(args))
    kwargs = tp.tree_map(prepare, dict(kwargs))
    return args, kwargs


__all__ = ["SEED", "build_model", "make_inputs"]
