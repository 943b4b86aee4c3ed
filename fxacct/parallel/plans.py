"""The tensor-parallel plan a model carries: Hugging Face models declare one as
``config.base_model_tp_plan`` (relative to the base model) and ``_tp_plan`` (the head), in
strings such as "colwise" and "rowwise"; a plain model may carry ``_tp_plan`` of FQN patterns to
``ParallelStyle`` objects. Wildcards ("layers.*.wq") are matched level by level as
``parallelize_module`` does; a pattern that names no module is a usage error."""

from __future__ import annotations

import fnmatch

import torch

from fxacct.errors import UsageError


def _style(value, key: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

    if isinstance(value, ParallelStyle):
        return value
    styles = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence_parallel": SequenceParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        # transformers 5.x names (integrations/tensor_parallel.py)
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    if value not in styles:
        raise UsageError(f"the model's tensor-parallel plan gives {key!r} the style {value!r}, which fxacct "
                         f"does not map; styles: {', '.join(styles)}; or give --parallelize PATH.py:fn")
    return styles[value]()


def model_plan(model: torch.nn.Module) -> dict:
    """FQN pattern -> style string or ParallelStyle, from the model's own declarations."""
    plan: dict = {}
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
        plan.update({prefix + k: v for k, v in base.items()})
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, dict):
        plan.update(own)
    return plan


def matches(model: torch.nn.Module, pattern: str) -> bool:
    parts = pattern.split(".")
    return any(len(n.split(".")) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))
               for n, _ in model.named_modules() if n)


def apply_model_plan(model: torch.nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    plan = model_plan(model)
    if not plan:
        raise UsageError(f"{type(model).__name__} carries no tensor-parallel plan (base_model_tp_plan or "
                         "_tp_plan): give --parallelize PATH.py:fn, called as fn(model, mesh)")
    missing = [k for k in plan if not matches(model, k)]
    if missing:
        raise UsageError(f"the tensor-parallel plan names {missing[0]!r}, which is not a module of "
                         f"{type(model).__name__}: fix the plan or give --parallelize PATH.py:fn")
    parallelize_module(model, tp_mesh, {k: _style(v, k) for k, v in plan.items()})
