"""DDP and ZeRO-1 against real runs (issue 23, item 5): ``--mesh dp=2`` (and with ``--zero1``)
runs for real in 2 CPU processes on gloo, with torch's own DDP (its C++ default all-reduce hook)
and ZeroRedundancyOptimizer; every rank's collectives (count and output-buffer bytes per op)
equal the account's exactly, and its op-level peak (fxacct's storage tracker, DDP's gradient
buckets counted from the step's start as the resident buffers they are) is within ±2% of the
predicted per-rank peak."""

from __future__ import annotations

import pytest
from helpers import target
from parallel_oracle import predicted_by_op

import fxacct
from fxacct.runtime.gloo_run import run_mesh

pytestmark = pytest.mark.slow  # each test spawns a gloo process group and runs real steps

LLAMA = target("examples/llama.py:Llama")


@pytest.mark.parametrize("kwargs, zero1, expected", [
    # 2 buckets: 1,049,088 + 1,443,840 B (tests/test_parallel_ddp.py derives them)
    ({"dim": 128, "hidden": 512}, False, {"all_reduce": [2, 2_492_928]}),
    # one bucket of 139,584 · 4 B; ZeRO-1's 21 broadcasts of every parameter after the step
    ({}, True, {"all_reduce": [1, 558_336], "broadcast": [21, 558_336]}),
], ids=["ddp-two-buckets", "ddp-zero1"])
def test_real_ddp_run_matches_the_account(kwargs, zero1, expected):
    cfg = fxacct.Config(target=LLAMA, batch=2, kwargs=kwargs, mesh="dp=2", zero1=zero1)
    p = fxacct.profile(cfg)
    assert predicted_by_op(p.parallel.rows) == expected
    ranks = run_mesh(cfg, steps=1, warmup=1)
    assert len(ranks) == 2
    peak = p.memory.peak_train.bytes
    for m in ranks:
        assert m.collectives == expected, (m.rank, m.collectives)
        assert abs(m.op_level_peak_bytes - peak) <= 0.02 * peak, (m.rank, m.op_level_peak_bytes, peak)
