"""The activation-checkpointing what-if (--checkpoint PATTERN, --checkpoint-policy): the modules
whose names match wrapped in torch.utils.checkpoint (non-reentrant) while a capture or a real run
calls the model, then unwrapped. Nothing about the model changes outside the context.

Patterns are fnmatch globs over named_modules() names ('h.*', 'layers.*'); since '*' also matches
dots, only the outermost match of a subtree is wrapped ('h.*' wraps h.0, h.1, ..., not h.0.attn).
A pattern that matches no module is a usage error. Policies (selective checkpointing through
torch.utils.checkpoint.create_selective_checkpoint_contexts): "save-matmuls" keeps the outputs
of matrix products and recomputes the rest; "PATH.py:fn" is a user's policy function
``fn(ctx, op, *args, **kwargs) -> CheckpointPolicy``, or a factory ``fn() -> policy`` called for
each checkpointed call, as torchtitan's per-op selective checkpointing makes a fresh policy (with
its own matmul counter) for every call of a block (``selective_checkpointing_context_fn``)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import itertools
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import torch
import torch.fx.traceback as fx_traceback
from torch.utils import checkpoint as ckpt

from fxacct.errors import UsageError, describe_exception
from fxacct.trace import torch_private as tp

SAVE_MATMULS = "save-matmuls"
_aten = torch.ops.aten
MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                        _aten._scaled_mm.default, _aten.convolution.default})


def save_matmuls(ctx, op, *args, **kwargs):
    """Keep what a matrix product made; recompute everything else."""
    return ckpt.CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else ckpt.CheckpointPolicy.PREFER_RECOMPUTE


def matched_modules(model: torch.nn.Module, patterns) -> list[str]:
    """Names of the outermost modules matching any pattern, in named_modules() order."""
    names = [n for n, _ in model.named_modules() if n]
    for p in patterns:
        if not any(fnmatchcase(n, p) for n in names):
            if not names:
                raise UsageError(f"--checkpoint {p!r}: the model has no submodule to checkpoint; drop --checkpoint")
            example = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise UsageError(f"--checkpoint {p!r} matches no module; module names look like: {example}")
    chosen: list[str] = []
    for n in names:
        if any(fnmatchcase(n, p) for p in patterns) and not any(n.startswith(c + ".") for c in chosen):
            chosen.append(n)
    modules = dict(model.named_modules())
    for n in chosen:  # a ModuleList / ModuleDict holds modules but runs no forward: wrapping it changes nothing
        if type(modules[n]).forward is torch.nn.Module.forward:
            raise UsageError(f"--checkpoint matches {n!r}, a {type(modules[n]).__name__}, which runs no forward of "
                             f"its own, so checkpointing it would change nothing: give its items, '{n}.*'")
    return chosen


def policy_function(spec: str | None):
    """The policy callable of --checkpoint-policy (None: plain checkpointing)."""
    if spec is None:
        return None
    if spec == SAVE_MATMULS:
        return save_matmuls
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not Path(path).is_file():
        raise UsageError(f"--checkpoint-policy {spec!r}: use {SAVE_MATMULS} or PATH.py:fn (an existing file)")
    module_spec = importlib.util.spec_from_file_location("fxacct_user_checkpoint_policy", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file
        raise UsageError(f"--checkpoint-policy {path} failed to load: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"--checkpoint-policy: {path} has no function {name!r}")
    if isinstance(fn, type) or not (is_factory(fn) or _takes(fn, None, None)):  # an nn.Module class, fn(x)
        raise UsageError(f"--checkpoint-policy {spec}: {name} is no policy fn(ctx, op, *args, **kwargs) -> "
                         "CheckpointPolicy, nor a factory fn() returning one")
    return fn


def _takes(fn, *args) -> bool:
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): torch's call will tell
        return True
    return True


def is_factory(fn) -> bool:
    """A policy factory takes no argument (a policy takes ctx and the op)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: a policy
        return False
    return not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in params)


def _context_fn(policy):
    if policy is None:
        return ckpt.noop_context_fn
    if is_factory(policy):
        return lambda: ckpt.create_selective_checkpoint_contexts(_guarded(_made(policy)))
    return functools.partial(ckpt.create_selective_checkpoint_contexts, _guarded(policy))


def _made(factory):
    """What a policy factory returned: a policy fn, or the list of ops to save torch also takes."""
    made = factory()
    if isinstance(made, (list, tuple)) or (callable(made) and not isinstance(made, (type, torch.nn.Module))
                                           and _takes(made, None, None)):
        return made
    raise UsageError(f"--checkpoint-policy: {factory.__name__}() returned a {type(made).__name__}, which is no "
                     "policy fn(ctx, op, *args, **kwargs) -> CheckpointPolicy nor a list of ops to save")


def _guarded(policy):
    """A policy fn whose failure is told as the policy's, not as the model's forward (where
    torch calls it: every op of a checkpointed region)."""
    if not callable(policy):
        return policy  # a list of ops: torch checks it

    @functools.wraps(policy)
    def run(ctx, op, *args, **kwargs):
        try:
            return policy(ctx, op, *args, **kwargs)
        except Exception as e:  # the user's policy
            raise UsageError(f"--checkpoint-policy {getattr(policy, '__name__', 'policy')} raised "
                             f"{describe_exception(e)} on {op}; it takes (ctx, op, *args, **kwargs) and "
                             "returns a CheckpointPolicy") from e

    return run


def _always_prefer_recompute(ctx, op, *args, **kwargs):
    return ckpt.CheckpointPolicy.PREFER_RECOMPUTE


_graph_ids = itertools.count(1)


def _tagged(forward, policy, args, kwargs):
    """A checkpointed call inside a compiled region (fxacct.trace.compiled), as torch.compile runs
    it: dynamo turns ``checkpoint`` into the ``tag_activation_checkpoint`` higher-order op, whose
    implementation under AOTAutograd (torch/_higher_order_ops/wrap.py,
    ``tag_activation_checkpoint_impl``) traces the region once through non-reentrant
    checkpointing with a selective context (the user's policy, or one that prefers to recompute
    every op), numbered with a graph id, RNG state not stashed and no early stop. The context tags
    each traced node with its policy and the id (torch/utils/checkpoint.py,
    ``_CachingTorchDispatchMode``), and inductor's partitioner, not autograd, then decides what
    the forward saves and what the backward recomputes."""
    base = _context_fn(policy if policy is not None else _always_prefer_recompute)
    graph_id = next(_graph_ids)

    def context_fn():
        forward_ctx, recompute_ctx = base()
        forward_ctx.ac_graph_id = graph_id
        return forward_ctx, recompute_ctx

    # as the implementation: the tags the context leaves in fx's current meta end with the region
    with fx_traceback.preserve_node_meta():
        return ckpt.checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, early_stop=False,
                               context_fn=context_fn, **kwargs)


def _wrapped(forward, policy):
    context_fn = _context_fn(policy)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # inference: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        if tp.aot_tracing(forward, args, kwargs):
            return _tagged(forward, policy, args, kwargs)
        modes = tuple(tp.function_mode_stack())

        def under_forward_modes(*a, **kw):
            # the backward engine recomputes without the TorchFunctionModes of the forward (fxacct's
            # AttentionScope, the CUDA rules): re-entered, the recompute takes the forward's kernels
            if tuple(tp.function_mode_stack()) == modes:
                return forward(*a, **kw)
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                return forward(*a, **kw)

        return ckpt.checkpoint(under_forward_modes, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def wrap(model: torch.nn.Module, patterns, policy_spec: str | None = None) -> dict:
    """Wrap model's matching modules for good (a real run's own model); returns {name: the
    forward set on the instance before, or None} for ``unwrap``."""
    policy = policy_function(policy_spec)
    modules = dict(model.named_modules())
    chosen = matched_modules(model, patterns)
    own = {name: modules[name].__dict__.get("forward") for name in chosen}
    for name in chosen:
        m = modules[name]
        m.forward = _wrapped(m.forward, policy)  # an instance attribute shadows the class's forward
    return own


def unwrap(model: torch.nn.Module, own: dict) -> None:
    modules = dict(model.named_modules())
    for name, forward in own.items():
        if forward is None:
            del modules[name].forward
        else:
            modules[name].forward = forward


@contextlib.contextmanager
def checkpointed(model: torch.nn.Module, patterns, policy_spec: str | None = None):
    """Within the context, model's matching modules run under non-reentrant checkpointing."""
    if not patterns:
        yield ()
        return
    own = wrap(model, patterns, policy_spec)
    try:
        yield tuple(own)
    finally:
        unwrap(model, own)


@dataclass(frozen=True)
class CheckpointSide:
    """One account of the what-if: activation bytes autograd saves outside checkpointed regions,
    the training peak (per rank), FLOPs re-run in the backward, and under --gpu the largest batch."""

    activation_bytes: int
    peak_train_bytes: int | None
    recompute_flops: int
    max_batch: int | None


@dataclass(frozen=True)
class CheckpointWhatIf:
    patterns: tuple[str, ...]
    modules: tuple[str, ...]  # the modules wrapped (outermost matches)
    policy: str | None
    checkpointed: CheckpointSide
    eager: CheckpointSide  # the same model without the wrapping (a second capture)
