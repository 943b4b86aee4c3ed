"""The stage modules of ``--mesh pp=P``. ``--pp-split`` is either the user's ``PATH.py:fn``
(``fn(model, stage, stages)`` returns the stage's module), or a comma list of the FQNs where
stages 1..P−1 begin (torchtitan's ``pipeline_parallel_split_points``: ``layers.2``,
``transformer.h.1``); without it, the split points that balance the traced cost of the model's
repeated blocks (fxacct.parallel.engine.repeated_blocks).

FQN and automatic splits cut the model with torch.distributed.pipelining's own front end,
``pipeline(model, mb_args, split_spec={fqn: SplitPoint.BEGINNING})`` (torch.export based; it runs
on meta tensors), so any model whose repeated blocks are found splits without a split function,
and the real run (fxacct.runtime.gloo_run) builds its stages the same way. A tied weight (GPT-2's
``wte``/``lm_head``) is then a parameter of every stage that uses one of its names, as pipeline()
builds it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from fxacct.errors import UsageError, classify
from fxacct.parallel.engine import repeated_blocks
from fxacct.trace import torch_private as tp


def is_function(pp_split: str | None) -> bool:
    return pp_split is not None and ".py:" in pp_split


def split_points(model, pp_split: str | None, stages: int, block_cost=None) -> list[str]:
    """The FQNs where stages 1..P−1 begin: the user's list (checked), or balanced (``block_cost``:
    () -> (cost before the blocks, [cost per block], cost after))."""
    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(b)] for b in repeated_blocks(model)]
    if pp_split:
        points = [p.strip() for p in pp_split.split(",") if p.strip()]
        known = set(names.values())
        for p in points:
            if p not in known:
                example = ",".join(blocks[i * len(blocks) // stages] for i in range(1, stages)) \
                    if len(blocks) >= stages else "layers.1"
                raise UsageError(f"--pp-split {p}: the model has no module {p!r}; give the {stages - 1} FQN"
                                 f"{'s' if stages > 2 else ''} where stages begin, such as {example}")
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


def _pipe(model, args, kwargs, points: list[str]):
    """torch.distributed.pipelining.pipeline's Pipe of ``model`` cut at ``points``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        with warnings.catch_warnings():  # torch.export's notices (pytree LeafSpec deprecations, attributes
            warnings.simplefilter("ignore")  # it sees assigned, as an LSTM's _flat_weights) are about its trace
            pipe = pipeline(model, mb_args=tuple(args), mb_kwargs=dict(kwargs) or None,
                            split_spec={p: SplitPoint.BEGINNING for p in points})
    except Exception as e:
        raise classify(e, f"splitting the model into pipeline stages at {', '.join(points)}") from e
    if pipe.num_stages != len(points) + 1:
        raise UsageError(f"splitting at {', '.join(points)} gave {pipe.num_stages} stages, not {len(points) + 1}: "
                         "give split points that the model's forward passes through in order")
    return pipe


def stage_module(model, args, kwargs, points: list[str], stage: int):
    """Stage ``stage`` of ``model`` cut at ``points`` by torch.distributed.pipelining.pipeline."""
    part = _pipe(model, args, kwargs, points).get_stage_module(stage)
    if not isinstance(part, torch.nn.Module):
        raise UsageError(f"pipeline stage {stage} is not an nn.Module")
    return _off_meta(part)


MODEL_INPUT = -1


@dataclass(frozen=True)
class StageInput:
    """One tensor a stage receives: made by stage ``source`` (the one before it; an earlier one is
    a skip connection, which fxacct.parallel.pipeline refuses), on meta, requiring grad as the
    forward made it (only those send a gradient back: torch's PipelineStage,
    ``_retrieve_recv_activations``)."""

    tensor: torch.Tensor
    source: int  # the stage that made it; MODEL_INPUT: the model's own input, no send

    @property
    def nbytes(self) -> int:  # sent contiguous (an expanded mask travels as its full shape)
        return self.tensor.numel() * self.tensor.element_size()


def stage_inputs(model, args, kwargs, points: list[str]) -> list[list[StageInput]]:
    """Per stage, the tensors it is called with (stage 0: none listed, it reads the model's inputs):
    the split graph of pipeline() run on meta with autograd on, each stage's call arguments as they
    are passed (the stage module's inputs, in order), each traced to the stage that made it."""
    pipe = _pipe(model, args, kwargs, points)
    made_by: dict[int, int] = {}
    received: list[list[StageInput]] = []

    class Stages(torch.fx.Interpreter):
        def call_module(self, target, call_args, call_kwargs):
            stage = len(received)
            received.append([StageInput(meta_like(a), made_by.get(id(a), MODEL_INPUT))
                             for a in tp.tree_leaves(call_args) if isinstance(a, torch.Tensor)] if stage else [])
            out = super().call_module(target, call_args, call_kwargs)
            for t in tp.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    made_by.setdefault(id(t), stage)
            return out

    names = [n.target for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]
    positional = iter(args)
    values = [kwargs[n] if n in kwargs else next(positional, None) for n in names]
    try:
        with torch.enable_grad():
            Stages(pipe.split_gm).run(*values)
    except Exception as e:
        raise classify(e, "running the pipeline stages on meta") from e
    return received


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous meta tensor of ``t``'s shape and dtype, requiring grad as ``t`` does."""
    m = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return m.requires_grad_(t.requires_grad and t.is_floating_point())


# torch.export records F.scaled_dot_product_attention as the aten op, which an interpreted stage
# calls below the torch-function layer, where the target-device rules choose the kernel a GPU runs
# (fxacct.trace.targets, rule 1): the stage calls the torch function again, as the model did.
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _off_meta(part):
    """Tensors the exported graph creates or checks on the device it was cut on (``arange(...,
    device=meta)``, ``.to(meta)``, export's ``_assert_tensor_metadata(..., device=meta)`` when the
    model was cut on meta) are made on the CPU, the device of fxacct's fake tensors: in the stage's
    own graph and in every nested one (torch.export's unflattened InterpreterModules). Attention is
    called as F.scaled_dot_product_attention (_SDPA)."""
    meta, cpu = torch.device("meta"), torch.device("cpu")

    def on_cpu(v):
        return cpu if isinstance(v, torch.device) and v == meta else v

    for gm in part.modules():
        graph = getattr(gm, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = False
        for n in graph.nodes:
            args, kwargs = tuple(on_cpu(a) for a in n.args), {k: on_cpu(v) for k, v in n.kwargs.items()}
            if args != n.args or kwargs != n.kwargs:
                n.args, n.kwargs, changed = args, kwargs, True
            if n.op == "call_function" and n.target is _SDPA:
                n.target, changed = torch.nn.functional.scaled_dot_product_attention, True
        if changed:
            compiled = gm if isinstance(gm, torch.fx.GraphModule) else getattr(gm, "graph_module", None)
            if compiled is not None:
                compiled.recompile()
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
