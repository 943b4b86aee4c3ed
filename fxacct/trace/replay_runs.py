"""Which blocks may share one template: runs of consecutive blocks of a ModuleList, Sequential
or ModuleDict (in insertion order: torchtitan keys its layers "0".."n-1") that are identical
before any op is compared (the rule, labels included, is documented in fxacct.trace.replay's
docstring; the ops themselves are compared there and in replay_train)."""

from __future__ import annotations

import torch

from fxacct.trace import torch_private as tp

_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set",
               "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_is_full_backward_hook",
               "forward"}


def _is_label(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _attrs(module: torch.nn.Module) -> tuple:
    """Plain attributes of every submodule: values compared by ==, objects by identity; an int
    appears as its type only (a possible label, see _labels_are_proven). FSDP2's per-module state
    (fully_shard's, under --mesh) appears as the kinds of state it holds: it acts in hooks around
    the block's forward, which run for every block, replayed or not; what it changes inside (the
    gathered parameters' dtypes, shapes and placements) is checked at each call (fxacct.trace.replay)."""
    out = []
    composable = tp.composable_state_keys()
    for name, m in module.named_modules():
        for k, v in sorted(vars(m).items()):
            if k in _SKIP_ATTRS:
                continue
            if k in composable and isinstance(v, dict):
                out.append((name, k, tuple((getattr(f, "__name__", f), type(x)) for f, x in v.items())))
            elif _is_label(v):
                out.append((name, k, int))
            elif isinstance(v, (int, float, str, bool, type(None), tuple, frozenset)):
                out.append((name, k, v))
            elif isinstance(v, torch.Tensor):
                out.append((name, k, tuple(v.shape), v.dtype))
            else:
                out.append((name, k, id(v)))
    return tuple(out)


def _labels(module: torch.nn.Module) -> dict:
    return {(name, k): v for name, m in module.named_modules() for k, v in vars(m).items()
            if k not in _SKIP_ATTRS and _is_label(v)}


def _tables(module: torch.nn.Module, blocks: int) -> list:
    """Per-layer tables a block can read: lists, tuples and dicts held by the plain objects (a
    Hugging Face config) its submodules reference, with one entry per block of the container
    (``layer_types``) or a name that says they are about layers (``mlp_only_layers``); other
    tables (``id2label``, a list of ``eos_token_id``) describe something else."""
    tables, seen = [], set()
    for m in module.modules():
        for v in vars(m).values():
            if id(v) in seen or isinstance(v, (torch.nn.Module, torch.Tensor, type)) or not hasattr(v, "__dict__"):
                continue
            seen.add(id(v))
            tables += [t for name, t in vars(v).items() if isinstance(t, (list, tuple, dict))
                       and (len(t) == blocks or "layer" in name)]
    return tables


def _entry(table, value):
    if isinstance(table, dict):
        return table.get(value, None), value in table
    return (table[value] if -len(table) <= value < len(table) else None), value in table


def _labels_are_proven(run, blocks: int) -> bool:
    """Whether blocks differing in int attributes may share one template (module docstring)."""
    labels = [_labels(m) for _, m in run]
    varying = [k for k in labels[0] if len({ls.get(k) for ls in labels}) > 1]
    if not varying:
        return True
    if any(labels[0][k] == labels[1][k] for k in varying):
        return False
    tables = _tables(run[0][1], blocks)
    return all(len({repr(_entry(t, ls[k])) for ls in labels}) == 1 for t in tables for k in varying)


def _split_by_labels(run, blocks: int) -> list:
    if _labels_are_proven(run, blocks):
        return [run]
    parts = [[run[0]]]
    for item in run[1:]:
        if _labels(item[1]) == _labels(parts[-1][0][1]):
            parts[-1].append(item)
        else:
            parts.append([item])
    return parts


def _signature(module: torch.nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    return (type(module), params, buffers, _attrs(module))


def find_runs(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Module]]]:
    """Runs of three or more consecutive identical blocks, with their FQNs."""
    owners: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(name)
    runs = []
    for name, container in model.named_modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            continue
        keyed = container.items() if isinstance(container, torch.nn.ModuleDict) else enumerate(container)
        items = [(f"{name}.{k}" if name else str(k), m) for k, m in keyed]
        run: list = []
        for fqn, m in items + [(None, None)]:
            if m is not None and run and _signature(m) == _signature(run[0][1]) and _own_params(m, fqn, owners):
                run.append((fqn, m))
                continue
            if len(run) >= 3:
                runs += [part for part in _split_by_labels(run, len(items)) if len(part) >= 3]
            run = [(fqn, m)] if m is not None and _own_params(m, fqn, owners) else []
    return runs


def _own_params(module, fqn: str, owners) -> bool:
    return all(all(o.startswith(fqn + ".") for o in owners[id(p)]) for p in module.parameters())
