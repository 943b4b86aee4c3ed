"""The loss fxacct differentiates: one definition for the trace and for real runs (docs/conventions.md, "The loss").

- ``sum`` (the default): the sum over every floating-point output tensor (pytree order) of
  ``t.float().sum()``, or only the output at index ``--loss-output`` of that list.
- ``cross-entropy``: on the first floating output (or ``--loss-output``), its class dimension C
  decided by its rank (``class_dim``): up to 3 dimensions, the last one (``[N, C]``, or a language
  model's logits ``[B, T, V]``, taken as ``F.cross_entropy(out.float().view(-1, V), target.view(-1))``,
  as nanoGPT and Hugging Face flatten them); from 4 dimensions, dim 1, as ``F.cross_entropy`` itself
  reads ``[B, C, d1, d2, ...]`` (segmentation: ``[B, 5, 32, 32]`` is 5 classes over 32×32 pixels),
  taken as ``F.cross_entropy(out.float(), target)``. The target is a long tensor of the output's
  shape without the class dimension, values in [0, C).
  For a causal language model the targets are the next tokens, as Hugging Face shifts its labels:
  the last position of each row is ``IGNORE_INDEX`` and the logits are not sliced.
- ``mse``: ``F.mse_loss(out.float(), target.float())``, the target shaped and typed like the output.
- ``model``: the model computes its own loss (Hugging Face with ``labels``, nanoGPT's
  ``forward(idx, targets)``): ``output.loss`` / ``output["loss"]``, else the one 0-dim floating
  output (or ``--loss-output``), used as is. Its FLOPs are then part of the forward.

The target is made once, before the loss, by the caller (``target_spec`` says its shape, dtype and
value bound): a fake placeholder in the trace, random values drawn once in a real run. It is an
input of the step, resident like the model's inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fxacct.errors import ModelError, UsageError
from fxacct.load.specs import CROSS_ENTROPY, LOSSES, MODEL, MSE, SUM, LossSpec  # noqa: F401  (re-exported)
from fxacct.trace import torch_private as tp

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index, Hugging Face's label padding


@dataclass(frozen=True)
class TargetSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    high: int | None  # integer targets: values in [0, high)
    causal: bool = False  # the last position of each row is IGNORE_INDEX

    def make(self, device, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random targets on a real device (fake ones in a FakeTensorMode: values never read)."""
        if self.high is None:
            return torch.randn(self.shape, generator=generator, device="cpu").to(device=device, dtype=self.dtype)
        t = torch.randint(0, self.high, self.shape, generator=generator, device="cpu", dtype=self.dtype)
        if self.causal and t.dim() >= 1:
            t[..., -1] = IGNORE_INDEX
        return t.to(device)


def _leaves(output) -> list:
    """pytree's leaves, with a plain @dataclass output opened field by field (pytree does not know
    it; Hugging Face's ModelOutput it does)."""
    out = []
    for x in tp.tree_leaves(output):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            out += _leaves([getattr(x, f.name) for f in dataclasses.fields(x)])
        else:
            out.append(x)
    return out


def _floating(output) -> list[torch.Tensor]:
    return [t for t in _leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _pick(leaves: list, index: int | None) -> list:
    if index is None:
        return leaves
    if not 0 <= index < len(leaves):
        raise UsageError(f"--loss-output {index} is out of range: the model returns {len(leaves)} "
                         f"floating-point tensor(s); pick an index from 0 to {len(leaves) - 1}")
    return [leaves[index]]


def loss_input(output, spec: LossSpec) -> torch.Tensor:
    """The output a cross-entropy or mse loss is taken of: the first floating one, or --loss-output."""
    leaves = _pick(_floating(output), spec.output)
    if not leaves:
        raise ModelError("the model returned no floating-point tensor to build a loss from; "
                         "return the logits or the loss from forward")
    return leaves[0]


def class_dim(out: torch.Tensor) -> int:
    """The class dimension cross-entropy reads in ``out``: the last up to 3 dimensions ([N, C], a
    language model's [B, T, V]), else 1 (F.cross_entropy's [B, C, d1, d2, ...])."""
    return out.dim() - 1 if out.dim() <= 3 else 1


def target_spec(output, spec: LossSpec) -> TargetSpec | None:
    """The target the loss needs for this output, or None (sum, model)."""
    if not spec.needs_target:
        return None
    out = loss_input(output, spec)
    if spec.kind == MSE:
        return TargetSpec(tuple(out.shape), out.dtype, None)
    if out.dim() == 0:
        raise UsageError("--loss cross-entropy needs logits with a class dimension, but the chosen output "
                         "is a scalar; pick the logits with --loss-output or use --loss model")
    c = class_dim(out)
    shape = tuple(out.shape[:c]) + tuple(out.shape[c + 1:])
    return TargetSpec(shape, torch.long, int(out.shape[c]), spec.causal and out.dim() == 3)


def training_loss(output, spec: LossSpec | int | None = None, target: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of ``output`` (see the module docstring); ``spec`` an int is --loss-output of the sum."""
    if not isinstance(spec, LossSpec):
        spec = LossSpec(SUM, spec)
    if spec.kind == MODEL:
        return model_loss(output, spec)
    if spec.kind == SUM:
        leaves = _pick(_floating(output), spec.output)
        if not leaves:
            raise ModelError("the model returned no floating-point tensor to build a loss from; "
                             "return the logits or the loss from forward")
        loss = leaves[0].float().sum()
        for t in leaves[1:]:
            loss = loss + t.float().sum()
        return loss
    out = loss_input(output, spec)
    if target is None:
        raise ValueError(f"--loss {spec.kind} needs a target (fxacct.trace.loss.target_spec)")
    if spec.kind == MSE:
        return F.mse_loss(out.float(), target.float())
    if class_dim(out) == 1 and out.dim() > 2:  # [B, C, d1, ...]: F.cross_entropy's own layout
        return F.cross_entropy(out.float(), target, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(out.float().view(-1, out.shape[-1]), target.view(-1), ignore_index=IGNORE_INDEX)


def returned_loss(output) -> bool:
    """The output carries a loss of its own (``output.loss`` / ``output["loss"]`` is a tensor)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return isinstance(loss, torch.Tensor)


def ignored_loss_warning(kind: str) -> str:
    return (f"the model returned its own loss, which --loss {kind} does not take as the loss (sum adds "
            "it to the other outputs): use --loss model to train on it")


def model_loss(output, spec: LossSpec) -> torch.Tensor:
    """The loss the model returned: output.loss / output["loss"], else its one 0-dim floating output."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = _floating(output)
    scalars = _pick(leaves, spec.output) if spec.output is not None else [t for t in leaves if t.dim() == 0]
    if len(scalars) == 1 and scalars[0].dim() == 0:
        return scalars[0]
    raise UsageError("--loss model: the model's output has no 'loss' and "
                     + (f"{len(scalars)} scalar floating outputs" if len(scalars) != 1 else "no scalar output")
                     + "; pass what it needs to compute one (e.g. --input 'labels=long[B,128]<VOCAB' or "
                     "'targets=...'), pick it with --loss-output, or use --loss cross-entropy")
