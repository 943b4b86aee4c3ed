"""The tensor-parallel plan a model carries: Hugging Face models declare one as
``config.base_model_tp_plan`` (relative to the base model) and ``_tp_plan`` (the head), in
strings such as "colwise" and "rowwise"; a plain model may carry ``_tp_plan`` of FQN patterns to
``ParallelStyle`` objects.

A Hugging Face model is parallelized by transformers' own engine, as ``from_pretrained(...,
tp_plan="auto")`` does (transformers.distributed, 5.x): the model resolves its plan
(``_resolve_parallel_plans``: config overrides, the embedding rule, wildcards expanded to one
entry per module or parameter) and ``apply_tensor_parallelism`` shards with its own styles (every
style it registers: "replicated_with_grad_allreduce", "packed_colwise", "moe_tp_experts", ...), so
the rank's account is that user's. Without that engine (an older transformers, a plain model),
fxacct maps the strings to torch's ParallelStyles itself; wildcards ("layers.*.wq") are matched
level by level as ``parallelize_module`` does; a pattern that names no module, or a style it
does not map, is a usage error."""

from __future__ import annotations

import fnmatch

import torch

from fxacct.errors import UsageError, classify

NO_PLAN = ("{} carries no tensor-parallel plan (base_model_tp_plan or _tp_plan): "
           "give --parallelize PATH.py:fn, called as fn(model, mesh)")


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


def transformers_engine():
    """(DistributedConfig, apply_tensor_parallelism) of the installed transformers, or None when
    it has no DTensor tensor-parallel engine of its own (before 5.x: transformers.distributed)."""
    try:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        return None
    return DistributedConfig, apply_tensor_parallelism


def apply_transformers_plan(model: torch.nn.Module, tp_mesh, engine) -> None:
    """The plan transformers resolves for ``DistributedConfig(tp_size=T)`` (TP only: the fsdp
    dims stay fxacct's, fxacct.parallel.engine), applied by transformers on the tp mesh."""
    config_cls, apply = engine
    if not getattr(model, "tp_plan", None):
        raise UsageError(NO_PLAN.format(type(model).__name__))
    try:
        plan, _, _ = model._resolve_parallel_plans(config_cls(tp_size=tp_mesh.size()))
    except ValueError as e:  # a style transformers does not know, a rule naming nothing
        msg = " ".join(str(e).split()).rstrip(".")
        raise UsageError(f"transformers could not resolve {type(model).__name__}'s tensor-parallel plan: {msg}; "
                         "give --parallelize PATH.py:fn, called as fn(model, mesh)") from e
    # transformers shards before it ties the weights (the checkpoint loads into the shards), then
    # ties the head to the embedding's shard; the model here comes tied: the shared parameter is
    # sharded once, by its first name's rule, and the second name points at that shard again
    aliases = tied_aliases(model)
    try:
        apply(model, tp_mesh, {k: v for k, v in plan.items() if k not in aliases})
    except Exception as e:
        raise classify(e, "transformers' apply_tensor_parallelism") from e
    retie(model, aliases)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """A tied parameter's second name -> its first ("lm_head.weight" -> "model.embed_tokens.weight")."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            aliases[name] = first[id(p)]
    return aliases


def retie(model: torch.nn.Module, aliases: dict[str, str]) -> None:
    """Point every second name at its first name's (now sharded) parameter again."""
    for alias, name in aliases.items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(name))


def apply_model_plan(model: torch.nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    engine = transformers_engine() if callable(getattr(model, "_resolve_parallel_plans", None)) else None
    if engine is not None:
        return apply_transformers_plan(model, tp_mesh, engine)
    plan = model_plan(model)
    if not plan:
        raise UsageError(NO_PLAN.format(type(model).__name__))
    missing = [k for k in plan if not matches(model, k)]
    if missing:
        raise UsageError(f"the tensor-parallel plan names {missing[0]!r}, which is not a module of "
                         f"{type(model).__name__}: fix the plan or give --parallelize PATH.py:fn")
    parallelize_module(model, tp_mesh, {k: _style(v, k) for k, v in plan.items()})
