"""The stage modules of ``--mesh pp=P``. ``--pp-split`` is either the user's ``PATH.py:fn``
(``fn(model, stage, stages)`` returns the stage's module), or a comma list of the FQNs where
stages 1..P−1 begin (torchtitan's ``pipeline_parallel_split_points``: ``layers.2``,
``transformer.h.1``); without it, the split points that balance the traced cost of the model's
repeated blocks (fxacct.parallel.engine.repeated_blocks).

FQN and automatic splits cut the model with torch.distributed.pipelining's own front end,
``pipeline(model, mb_args, split_spec={fqn: SplitPoint.BEGINNING})`` (torch.export based; it runs
on meta tensors), so any model whose repeated blocks are found splits without a split function,
and the real run (fxacct.parallel.gloo_run) builds its stages the same way. A tied weight (GPT-2's
``wte``/``lm_head``) is then a parameter of every stage that uses one of its names, as pipeline()
builds it.
"""

from __future__ import annotations

import warnings

import torch

from fxacct.errors import UsageError, classify


def is_function(pp_split: str | None) -> bool:
    return pp_split is not None and ".py:" in pp_split


def split_points(model, pp_split: str | None, stages: int, block_cost=None) -> list[str]:
    """The FQNs where stages 1..P−1 begin: the user's list (checked), or balanced (``block_cost``:
    () -> (cost before the blocks, [cost per block], cost after))."""
    from fxacct.parallel.engine import repeated_blocks

    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(b)] for b in repeated_blocks(model)]
    if pp_split:
        points = [p.strip() for p in pp_split.split(",") if p.strip()]
        known = set(names.values())
        for p in points:
            if p not in known:
                raise UsageError(f"--pp-split {p}: the model has no module {p!r}; give the FQNs where stages "
                                 f"begin, such as {', '.join(blocks[1:3]) or 'layers.1'}")
        if len(points) != stages - 1:
            raise UsageError(f"--pp-split {pp_split} gives {len(points) + 1} stages but --mesh has pp={stages}: "
                             f"give {stages - 1} FQN{'s' if stages > 2 else ''} where stages begin")
        return points
    pre, costs, post = block_cost()
    return [blocks[i] for i in balanced_cuts(pre, costs, post, stages)]


def balanced_cuts(pre: int, costs: list[int], post: int, stages: int) -> list[int]:
    """Indices of the blocks that begin stages 1..P−1: contiguous blocks, the largest stage cost
    (the first stage adds ``pre``, the last ``post``) as small as it goes; every stage gets a block.
    Dynamic programming over (blocks used, stages used)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (stages + 1) for _ in range(n + 1)]  # best[i][k]: blocks[:i] in k stages
    cut = [[0] * (stages + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (pre if k == 1 else 0) + (post if k == stages else 0)
                worst = max(best[j][k - 1], cost)
                if worst < best[i][k]:
                    best[i][k], cut[i][k] = worst, j
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = cut[i][k]
        cuts.append(i)
    return cuts[::-1]


def stage_module(model, args, kwargs, points: list[str], stage: int):
    """Stage ``stage`` of ``model`` cut at ``points`` by torch.distributed.pipelining.pipeline."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        with warnings.catch_warnings():  # torch.export's own deprecation notices (pytree LeafSpec) are not the user's
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(model, mb_args=tuple(args), mb_kwargs=dict(kwargs) or None,
                            split_spec={p: SplitPoint.BEGINNING for p in points})
    except Exception as e:
        raise classify(e, f"splitting the model into pipeline stages at {', '.join(points)}") from e
    if pipe.num_stages != len(points) + 1:
        raise UsageError(f"splitting at {', '.join(points)} gave {pipe.num_stages} stages, not {len(points) + 1}: "
                         "give split points that the model's forward passes through in order")
    part = pipe.get_stage_module(stage)
    if not isinstance(part, torch.nn.Module):
        raise UsageError(f"pipeline stage {stage} is not an nn.Module")
    return _off_meta(part)


def _off_meta(part):
    """Tensors the exported graph creates (``arange(..., device=meta)`` when the model was cut on
    meta) are made on the CPU, the device of fxacct's fake tensors."""
    meta = torch.device("meta")
    for gm in part.modules():
        if isinstance(gm, torch.fx.GraphModule):
            nodes = [n for n in gm.graph.nodes if n.kwargs.get("device") == meta]
            for n in nodes:
                n.update_kwarg("device", torch.device("cpu"))
            if nodes:
                gm.recompile()
    return part


def block_costs(accounting, blocks: list[str]) -> tuple[int, list[int], int]:
    """(FLOPs before the first block, FLOPs per block, FLOPs after the last block), forward and
    backward, from a traced step's node rows in graph order."""
    pre = post = 0
    costs = [0] * len(blocks)
    seen_block = False
    for row in accounting.nodes:
        flops = row.forward.total + row.backward.total
        i = next((k for k, b in enumerate(blocks) if row.module == b or row.module.startswith(b + ".")), None)
        if i is not None:
            costs[i] += flops
            seen_block = True
        elif seen_block:
            post += flops
        else:
            pre += flops
    return pre, costs, post
