"""Float8 training (``--fp8 tensorwise|rowwise``): the model's linear layers converted with
torchao's ``convert_to_float8_training`` (torchao.float8, the optional extra ``fxacct[fp8]``), as
torchtitan's float8 converter does, so that the casts of inputs, weights and gradients to
float8_e4m3fn, their scales and ``aten._scaled_mm`` run in the traced step as they run in training.

The recipes are torchao's (``Float8LinearConfig.from_recipe_name``): ``tensorwise`` (one scale
per tensor) and ``rowwise`` (one scale per row, the gradients' casts along the other axis).
torch 2.13's CPU build runs ``_scaled_mm`` (and has its fake kernel), so torchao's ``emulate``
option (plain ``mm`` on upcast tensors) is not needed: the traced ops are those of a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch

from fxacct.errors import UsageError

RECIPES = ("tensorwise", "rowwise")
# torch._scaled_mm takes matrices whose dimensions are multiples of 16 (torchao's Float8Linear
# refuses others: torchao/float8/float8_linear_utils.py, and torchtitan filters them out the same way)
MULTIPLE = 16


def check(recipe: str | None) -> None:
    """The --fp8 value and torchao's presence, before any tracing."""
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise UsageError(f"--fp8 {recipe!r}: use one of {', '.join(RECIPES)} (torchao's float8 recipes)")
    if importlib.util.find_spec("torchao") is None:
        raise UsageError(f"--fp8 {recipe} converts linear layers with torchao's float8 training, and torchao is "
                         "not installed: pip install 'fxacct[fp8]' (or pip install torchao)")


def float8_tensor_type():
    """torchao's tensor subclass of a float8 operand (its ops desugar into casts and _scaled_mm)."""
    with quiet_torchao():
        from torchao.float8.float8_training_tensor import Float8TrainingTensor
    return Float8TrainingTensor


def eligible(module: torch.nn.Module, fqn: str) -> bool:
    """An nn.Linear whose both dimensions _scaled_mm takes."""
    return (isinstance(module, torch.nn.Linear) and module.in_features % MULTIPLE == 0
            and module.out_features % MULTIPLE == 0)


def convert(model: torch.nn.Module, recipe: str | None) -> list[str]:
    """Swap every eligible nn.Linear of ``model`` for torchao's Float8Linear (in place; meta or
    real); returns the FQNs converted. None: nothing to do."""
    if recipe is None:
        return []
    check(recipe)
    with quiet_torchao():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    names = [n for n, m in model.named_modules() if eligible(m, n)]
    if not names:
        raise UsageError(f"--fp8 {recipe}: the model has no nn.Linear whose dimensions are multiples of "
                         f"{MULTIPLE}, which float8 matmuls (_scaled_mm) need; drop --fp8")
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=eligible)
    return names


@contextlib.contextmanager
def quiet_torchao():
    """torchao logs a warning for each CUDA extension it cannot load on a CPU-only machine
    (torchao/__init__.py) as it is imported: by --fp8's conversion, or by transformers' modeling
    classes wherever torchao is installed (fxacct.load.hf); they are not the user's concern here."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]  # and its Enum notice
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
