"""The collectives one pipeline rank issues in a step, from its stages' one-micro-batch traces
and the order its schedule runs them in.

A stage's trace is one plain FSDP2 step: every unit gathered in forward, the units resharded after
forward gathered again in backward, one reduce-scatter per unit. torch.distributed.pipelining drives
FSDP2 differently over M micro-batches (torch 2.13 ``stage.py``: ``backward_maybe_with_nosync``
turns resharding after backward and gradient reduction off for every micro-batch's backward, and
``perform_reduce_grad`` reduces and reshards once, after the last one). So, per stage and step:

- a unit is sharded at the step's first forward; after a forward it is sharded again if it reshards
  after forward (the units the trace gathers in backward); after a backward it stays gathered;
- a forward or backward gathers each unit it finds sharded: the first forward gathers every unit, a
  forward that follows a forward the resharded ones, a backward that follows a forward the
  resharded ones, and one that follows a backward nothing;
- the reduce-scatters (and HSDP's all-reduces) run once, at the end;
- collectives on the other mesh dims (tensor parallelism's) run in every micro-batch: M times.

Checked against real gloo runs of the same configuration (tests/test_parallel_gloo.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from fxacct.parallel.collectives import CollectiveNode, CollectiveRow, rows
from fxacct.trace.dispatch_recorder import BACKWARD, FORWARD, LOSS

# the mesh dims FSDP2 shards (fsdp) and replicates (dp, HSDP) over; a torchtitan job names its
# replicate dim dp_replicate (fxacct.parallel.torchtitan.process_groups)
FSDP_DIMS = ("dp", "fsdp", "dp_replicate")


def gathers_per_step(kinds: list[str]) -> tuple[int, int]:
    """(forwards that follow a forward, backwards that follow a forward) in one stage's order of
    "F" and "B" actions; the first forward is not counted (it gathers every unit)."""
    f_after_f = sum(1 for prev, k in zip(kinds, kinds[1:]) if prev == "F" and k == "F")
    b_after_f = sum(1 for prev, k in zip(kinds, kinds[1:]) if prev == "F" and k == "B")
    return f_after_f, b_after_f


def _resharded(nodes) -> set[str]:
    """The forward all-gathers of units that reshard after forward: one per backward all-gather
    of the same size (units of one size are interchangeable in every total)."""
    left = Counter(c.bytes for c in nodes if c.op == "all_gather" and c.phase == BACKWARD and c.mesh_dim in FSDP_DIMS)
    out = set()
    for c in nodes:
        if c.op == "all_gather" and c.phase == FORWARD and c.mesh_dim in FSDP_DIMS and left[c.bytes] > 0:
            left[c.bytes] -= 1
            out.add(c.node)
    return out


def per_step(nodes: tuple[CollectiveNode, ...], kinds: list[str], microbatches: int) -> dict[str, int]:
    """Node -> how many times a step issues it (module docstring)."""
    f_after_f, b_after_f = gathers_per_step(kinds)
    resharded = _resharded(nodes)
    times = {}
    for c in nodes:
        if c.mesh_dim not in FSDP_DIMS:
            times[c.node] = microbatches if c.phase in (FORWARD, BACKWARD, LOSS) else 1
        elif c.op == "all_gather" and c.phase == FORWARD:
            times[c.node] = 1 + (f_after_f if c.node in resharded else 0)
        elif c.op == "all_gather" and c.phase == BACKWARD:
            times[c.node] = b_after_f
        else:
            times[c.node] = 1
    return times


def rank_rows(stages: dict, actions, microbatches: int) -> tuple[CollectiveRow, ...]:
    """A rank's collectives of one step, summed as fxacct.parallel.collectives.rows does.
    ``stages``: stage index -> its ParallelAccount (None: a stage on pp alone issues none)."""
    expanded, seconds = [], {}
    for s, par in stages.items():
        if par is None:
            continue
        kinds = [kind for kind, st, _ in actions if st == s]
        times = per_step(par.collectives, kinds, microbatches)
        for c in par.collectives:
            name = f"{s}:{c.node}"  # node names repeat across stages
            if par.node_seconds is not None:
                seconds[name] = par.node_seconds.get(c.node, 0.0)
            expanded += [replace(c, node=name)] * times[c.node]
    timed = stages and all(p is None or p.node_seconds is not None for p in stages.values())
    return rows(tuple(expanded), seconds if timed else None)
