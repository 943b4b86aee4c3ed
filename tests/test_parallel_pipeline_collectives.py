"""fxacct.parallel.pipeline_collectives: how many times a pipeline step issues each collective of
a stage's one-micro-batch trace, against the closed forms of torch's pipelining over FSDP2."""

from __future__ import annotations

from fxacct.parallel.collectives import CollectiveNode
from fxacct.parallel.pipeline_collectives import gathers_per_step, per_step


def _node(name, op, phase, nbytes, dim="fsdp"):
    return CollectiveNode(name, op, dim, 2, phase, "", nbytes, nbytes // 2)


# one micro-batch of a stage with a root unit (kept gathered after forward, 100 B) and two blocks
# (resharded after forward, 60 B each), and a tensor-parallel all-reduce per micro-batch
TRACE = (_node("ag_root", "all_gather", "forward", 100), _node("ag_b0", "all_gather", "forward", 60),
         _node("ag_b1", "all_gather", "forward", 60), _node("ar_tp", "all_reduce", "forward", 8, dim="tp"),
         _node("ag_b1_bwd", "all_gather", "backward", 60), _node("ag_b0_bwd", "all_gather", "backward", 60),
         _node("rs_b1", "reduce_scatter", "backward", 30), _node("rs_b0", "reduce_scatter", "backward", 30),
         _node("rs_root", "reduce_scatter", "backward", 50))


def test_gathers_follow_the_order():
    # 1F1B stage 0 of 2, M = 4: F F B F B F B B. Forwards after a forward: 1 (the second);
    # backwards after a forward: 3 (all but the last)
    assert gathers_per_step(list("FFBFBFBB")) == (1, 3)
    # GPipe, M = 4: F F F F B B B B: 3 forwards after a forward, 1 backward
    assert gathers_per_step(list("FFFFBBBB")) == (3, 1)
    # M = 1: F B
    assert gathers_per_step(list("FB")) == (0, 1)


def test_per_step_counts():
    times = per_step(TRACE, list("FFBFBFBB"), 4)
    # the root is gathered once (first forward); each block at the first forward and the second
    assert times["ag_root"] == 1 and times["ag_b0"] == times["ag_b1"] == 2
    assert times["ag_b0_bwd"] == times["ag_b1_bwd"] == 3  # the backwards after a forward
    assert times["rs_b0"] == times["rs_b1"] == times["rs_root"] == 1  # once, after the last backward
    assert times["ar_tp"] == 4  # tensor parallelism runs in every micro-batch


def test_no_unit_resharded_after_forward_gathers_once():
    """reshard_after_forward=False everywhere: nothing is gathered in backward, and every unit once."""
    trace = tuple(c for c in TRACE if c.phase == "forward" or c.op == "reduce_scatter")
    times = per_step(trace, list("FFFFBBBB"), 4)
    assert times["ag_root"] == times["ag_b0"] == times["ag_b1"] == 1
