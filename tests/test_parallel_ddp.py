"""Plain data parallelism (``--mesh dp=N`` alone: DDP through torch's ``replicate``) and ZeRO-1
(``--zero1``: torch's ZeroRedundancyOptimizer), traced on rank 0 under the fake process group
(issue 23, item 3). The byte figures are derived by hand below; the real gloo runs that hold the
same figures against the engine are in tests/test_parallel_ddp_gloo.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers import target

import fxacct
from fxacct_cli.main import cli

LLAMA = target("examples/llama.py:Llama")
WIDE = {"dim": 128, "hidden": 512}  # 623,232 parameters: more than DDP's 1 MiB first bucket

# examples/llama.py at its defaults (vocab 512, dim 64, 2 layers, 4 heads of 16, 2 kv heads, hidden 128):
# tok_embeddings 512·64 = 32,768; output 64·512 = 32,768; per layer wq 64·64 = 4,096, wk = wv = 64·32 = 2,048,
# wo 4,096, w1 = w2 = w3 = 64·128 = 8,192, two norms of 64; the final norm 64: 139,584 in all, 21 tensors
PARAMS, TENSORS = 139_584, 21
ROPE_BYTES = 2 * 64 * 16 * 4  # the rope buffer: cos and sin, (2, max_seq 64, head_dim 16), float32


def profile(mesh: str, zero1: bool = False, **kwargs) -> fxacct.Profile:
    return fxacct.profile(fxacct.Config(target=LLAMA, batch=2, mesh=mesh, zero1=zero1, kwargs=kwargs))


def test_ddp_all_reduces_each_gradient_bucket_as_it_runs():
    """dp=2 on the wide Llama: 623,232 parameters, 4 B each = 2,492,928 B of gradients (dim 128,
    hidden 512: per layer wq 128·128, wk = wv = 128·64, wo 128·128, w1 = w2 = w3 = 128·512, two
    norms of 128, = 246,016; embedding and output 512·128 each, final norm 128).

    DDP's steady-state buckets (after the first iteration's rebuild, torch/nn/parallel/
    distributed.py _BucketCapacityConfig and reducer.cpp rebuild_buckets) are cut in the order the
    backward makes gradients ready, the first closed once it reaches dist._DEFAULT_FIRST_BUCKET_BYTES
    = 1 MiB = 1,048,576 B: output 262,144 + norm 512 + layers.1's w2, w1, w3 (262,144 each) =
    1,049,088 B; the rest, 1,443,840 B, stays under bucket_cap_mb = 25 MiB: a second bucket. Each is
    all-reduced once in the backward (ring wire bytes 2·(n−1)/n·S = S at n = 2), and DDP keeps the
    bucket buffers between steps: resident, with the rope buffer (2·64·32·4 = 16,384 B)."""
    p = profile("dp=2", **WIDE)
    reduces = [(c.op, c.mesh_dim, c.phase, c.group_size, c.bytes, c.wire_bytes) for c in p.parallel.collectives]
    assert reduces == [("all_reduce", "dp", "backward", 2, 1_049_088, 1_049_088),
                       ("all_reduce", "dp", "backward", 2, 1_443_840, 1_443_840)]
    assert 1_049_088 + 1_443_840 == 4 * 623_232
    assert p.memory.peak_train.category("buffers") == 4 * 623_232 + 2 * 64 * 32 * 4
    assert p.accounting.totals.params == 623_232  # DDP replicates: every rank holds the whole model


def test_ddp_step_is_the_one_device_step_plus_its_buckets():
    """The model's own work is unchanged by DDP: forward FLOPs, the backward's matmul and attention
    FLOPs and what autograd saves equal one device's; the backward adds DDP's averaging, one divide
    per gradient element (139,584), and the rank one all-reduce (all 139,584 · 4 = 558,336 B fit the
    1 MiB first bucket) and the bucket buffer of the same size, resident."""
    one = fxacct.profile(fxacct.Config(target=LLAMA, batch=2))
    p = profile("dp=2")
    mine, theirs = p.accounting.totals, one.accounting.totals
    assert mine.forward == theirs.forward
    assert (mine.backward.matmul, mine.backward.attention) == (theirs.backward.matmul, theirs.backward.attention)
    assert mine.backward.other - theirs.backward.other == PARAMS
    assert p.accounting.totals.activation_bytes == one.accounting.totals.activation_bytes
    assert [(r.op, r.count, r.bytes) for r in p.parallel.rows] == [("all_reduce", 1, 4 * PARAMS)]
    assert p.memory.peak_train.category("buffers") == ROPE_BYTES + 4 * PARAMS


def test_zero1_keeps_only_its_partition_of_the_optimizer_state():
    """ZeroRedundancyOptimizer partitions the parameters largest first, each to the rank holding the
    fewest elements so far (ties to the lower rank; torch/distributed/optim/zero_redundancy_optimizer.py,
    _partition_parameters): tok_embeddings and output 32,768 each -> rank 0, rank 1; the six 8,192s
    alternate (r0 57,344, r1 57,344); the four 4,096s, the four 2,048s alternate (69,632 each); the
    five 64s go r0, r1, r0, r1, r0. Rank 0: 69,824 elements in 1 + 3 + 2 + 2 + 3 = 11 tensors.
    AdamW keeps exp_avg and exp_avg_sq (4 B each per element) and a float32 step per tensor:
    2·4·69,824 + 11·4 = 558,636 B, against 2·4·139,584 + 21·4 = 1,116,756 B unsharded. After the
    step every parameter is broadcast from its owner: 21 broadcasts of 558,336 B in all."""
    plain, zero = profile("dp=2"), profile("dp=2", zero1=True)
    assert plain.memory.optimizer_bytes == 2 * 4 * PARAMS + TENSORS * 4 == 1_116_756
    assert zero.memory.optimizer_bytes == 2 * 4 * 69_824 + 11 * 4 == 558_636
    assert [(r.op, r.phase, r.count, r.bytes) for r in zero.parallel.rows] == [
        ("all_reduce", "backward", 1, 4 * PARAMS), ("broadcast", "optimizer", TENSORS, 4 * PARAMS)]
    # the state no longer held is the only difference at the peak
    drop = plain.memory.peak_train.bytes - zero.memory.peak_train.bytes
    assert drop == 1_116_756 - 558_636


def test_zero1_over_one_rank_is_the_plain_optimizer_plus_its_broadcasts():
    """--mesh dp=1 --zero1: one rank owns every parameter, so the state, FLOPs and peaks are the
    plain optimizer's; the 21 broadcasts remain (to a group of one: no wire bytes)."""
    plain, zero = profile("dp=1"), profile("dp=1", zero1=True)
    for key in ("forward", "backward", "activation_bytes", "params"):
        assert getattr(zero.accounting.totals, key) == getattr(plain.accounting.totals, key), key
    assert zero.memory.optimizer_bytes == plain.memory.optimizer_bytes == 1_116_756
    assert zero.memory.peak_train.bytes == plain.memory.peak_train.bytes
    assert [(r.op, r.count, r.bytes, r.wire_bytes) for r in zero.parallel.rows] == [
        ("broadcast", TENSORS, 4 * PARAMS, 0)]


def test_ddp_dedup_and_full_trace_agree():
    """Repeated blocks replay under DDP too: its gradient hooks fire for replayed blocks' parameters,
    so --no-dedup gives the same collectives, FLOPs and peak (3 layers, ZeRO-1 on)."""
    a, b = (fxacct.profile(fxacct.Config(target=LLAMA, batch=2, mesh="dp=2", zero1=True, dedup=d,
                                         kwargs={"n_layers": 3})) for d in (True, False))
    assert a.parallel.rows == b.parallel.rows
    assert a.accounting.totals == b.accounting.totals
    assert a.memory.peak_train == b.memory.peak_train


def run(*args: str):
    return CliRunner().invoke(cli, ["profile", "examples/llama.py:Llama", "--batch", "2", *args])


@pytest.mark.parametrize("args, says", [
    (("--zero1",), "add --mesh dp=N"),
    (("--zero1", "--mesh", "fsdp=2"), "drop --zero1"),
    (("--zero1", "--mesh", "dp=2,fsdp=2"), "drop --zero1"),
    (("--zero1", "--mesh", "dp=2,tp=2"), "use --mesh dp=2"),
    (("--zero1", "--mesh", "dp=2", "--optimizer", "none"), "--optimizer none"),
    (("--mesh", "dp=2,tp=2"), "dp=R,fsdp=S,tp=T"),
    (("--mesh", "pp=2,dp=2"), "inside pipeline stages"),
], ids=["no-mesh", "fsdp", "hsdp", "tp", "no-optimizer", "ddp-tp", "ddp-pp"])
def test_zero1_and_ddp_misuse_is_one_line_exit_2(args, says):
    result = run(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def test_zero1_reaches_json_through_the_cli():
    """--zero1 on the command line is the library's Config(zero1=True): the broadcasts and the
    halved optimizer state are in the JSON document."""
    result = CliRunner().invoke(cli, ["profile", "examples/llama.py:Llama", "--batch", "2", "--mesh", "dp=2",
                                      "--zero1", "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["config"]["zero1"] is True
    assert doc["totals"]["optimizer_bytes"] == 558_636
    assert sum(c["count"] for c in doc["collectives"] if c["op"] == "broadcast") == TENSORS
