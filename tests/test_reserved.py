"""Reserved memory of a profiled step (fxacct.memory.reserved): the step's storages through the
caching-allocator model, checked end to end on a model whose reserved bytes can be derived by hand,
and the places it reaches (JSON, text, the CPU case, FSDP2's streams, --alloc-conf)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import target

import fxacct
from fxacct.errors import UsageError
from fxacct.load.config import Config
from fxacct.memory.fixed import CUDA_CONTEXT_BYTES
from fxacct.memory.reserved import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM
from fxacct_cli.main import cli

MiB = 2**20
MLP = [target("examples/mlp.py:MLP"), "-k", "d_model=64", "-k", "d_hidden=128", "-k", "n_blocks=2"]


def run(*args: str):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def linear_2048():
    with torch.device("meta"):
        model = torch.nn.Linear(2048, 2048, bias=False)
    x = torch.empty(2048, 2048, device="meta")
    return fxacct.profile_module(model, (x,), config=Config(gpu="h100", optimizer="sgd", find_max_batch=False,
                                                                  alloc_conf=""))  # torch's defaults, whatever the environment says


def test_reserved_of_a_step_of_16mib_tensors_by_hand(linear_2048):
    """Linear(2048, 2048, no bias) on x [2048, 2048], fp32, SGD without momentum (no state; its foreach
    add_ is in place), loss = y.sum() on an H100. Every tensor of the step but the loss scalars is
    2048·2048·4 B = 16 MiB: W and x (resident), y = x @ Wᵀ (dies once the loss is built: sum's
    backward saves nothing), dW = gyᵀ @ x in the backward (kept: the step's gradients). So at most
    three 16 MiB tensors are live (W, x, y; then W, x, dW).
    Allocator (CUDACachingAllocator.cpp): a 16 MiB request is >= kMinLargeAlloc, so its segment is 16 MiB
    exactly (a multiple of kRoundLarge) and never split; dW reuses y's cached block (same size, same
    stream). cuBLAS workspaces (32 MiB on compute capability 9.0, allocated through the allocator), one
    per thread's handle: the forward's at y's mm, autograd's backward thread's at dW's mm, each one more
    32 MiB segment. The scalars (loss, its gradient seed: < 1 MiB) share one 2 MiB small-pool segment.
    The second step takes every block from the cache, so the replay ends there. Reserved:
    2·32 + 3·16 + 2 = 114 MiB; allocated at most 2·32 + 3·16 MiB + two 512 B blocks (the round_size of
    two live scalars)."""
    m = linear_2048.memory
    r = m.reserved
    assert r.peak_reserved_bytes == 114 * MiB
    assert r.by_pool_stream == (("large", "default", 112 * MiB), ("small", "default", 2 * MiB))
    assert r.peak_allocated_bytes == 112 * MiB + 2 * 512
    assert m.rank_peak.bytes == 3 * 16 * MiB + 8  # the op-level peak: W, x, dW and two float32 scalars
    assert r.peak_reserved_bytes >= m.rank_peak.bytes
    # fixed: the CUDA context outside the allocator; the workspaces inside reserved, not counted twice
    assert r.fixed_outside_bytes == CUDA_CONTEXT_BYTES
    assert [f.bytes for f in r.fixed if f.inside_reserved] == [32 * MiB, 32 * MiB]
    assert m.fit.peak_bytes == 114 * MiB + CUDA_CONTEXT_BYTES and m.fit.basis == "peak_reserved_bytes + fixed"


def test_the_first_steps_optimizer_state_fragments_the_second_step_by_hand():
    """The same Linear on x [4096, 2048] (32 MiB; W 16 MiB) with Adam, which makes its state (exp_avg,
    exp_avg_sq: 16 MiB each) at its first step, where torch.optim's _init_group does. By hand:
    set-up x, W: 48 MiB. Step 1: y (32 MiB) a new segment A, the forward's workspace 32: 112; the loss
    scalars a 2 MiB small segment: 114. y dies; dW (16 MiB) takes A's first half (a large block is split
    when more than 1 MiB remains), the backward thread's workspace a new 32: 146. The optimizer makes
    exp_avg in A's free half, exp_avg_sq a new 16: 162, and _foreach_sqrt's temporary a new 16: 178.
    Step 2: y finds no free block of 32 MiB (A holds exp_avg): a new segment, 210; dW and the temporary
    take the freed 16 MiB blocks. Step 3 takes everything from the cache. A replay of one steady step
    with the state resident from the start says 178 MiB: that is what torch.cuda.max_memory_reserved of
    a run's first step is, not of the run."""
    with torch.device("meta"):
        model = torch.nn.Linear(2048, 2048, bias=False)
    x = torch.empty(4096, 2048, device="meta")
    prof = fxacct.profile_module(model, (x,), config=Config(gpu="h100", optimizer="adam", find_max_batch=False,
                                                                  alloc_conf=""))
    r = prof.memory.reserved
    assert r.peak_reserved_bytes == 210 * MiB
    assert r.by_pool_stream == (("large", "default", 208 * MiB), ("small", "default", 2 * MiB))
    # at _foreach_sqrt: x, W, two workspaces, dW, both states, the temporary; the loss and the step count
    assert r.peak_allocated_bytes == (32 + 16 + 64 + 4 * 16) * MiB + 2 * 512


def test_json_and_text_carry_reserved_allocated_and_fixed():
    doc = json.loads(run("profile", *MLP, "--gpu", "h100", "--no-max-batch", "--format", "json"))
    r, fixed = doc["memory"]["reserved"], doc["memory"]["fixed"]
    assert doc["totals"]["peak_reserved_bytes"] == r["peak_reserved_bytes"] >= doc["totals"]["peak_train_bytes"]
    assert sum(p["bytes"] for p in r["by_pool_stream"]) == r["peak_reserved_bytes"]
    assert r["fit_bytes"] == r["peak_reserved_bytes"] + sum(f["bytes"] for f in fixed if not f["inside_reserved"])
    assert doc["memory"]["fit"]["peak_bytes"] == r["fit_bytes"]
    assert {f["name"] for f in fixed} == {"CUDA context", "cuBLAS/cuBLASLt workspace (forward thread)",
                                          "cuBLAS/cuBLASLt workspace (backward thread)"}
    assert all(f["source"] for f in fixed)
    text = run("profile", *MLP, "--gpu", "h100", "--no-max-batch", "--summary")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("reserved"))
    assert "as the CUDA caching allocator holds it (allocated" in line and "CUDA context 400.00 MiB" in line, line


def test_a_cpu_profile_says_nothing_of_reserved():
    doc = json.loads(run("profile", *MLP, "--format", "json"))
    assert doc["totals"]["peak_reserved_bytes"] is None
    assert doc["memory"]["reserved"] is None and doc["memory"]["fixed"] is None
    assert "reserved" not in run("profile", *MLP, "--summary")


def test_fsdp2_buffers_are_reserved_on_their_streams():
    """--mesh fsdp=2: FSDP2's all-gather outputs sit in the all-gather copy-in stream's pool and its
    reduce-scatter outputs in the reduce-scatter stream's (torch 2.13 _fsdp_collectives.py); each rank
    adds one NCCL communicator (the fsdp dim) to the fixed lines."""
    doc = json.loads(run("profile", *MLP, "--gpu", "h100", "--mesh", "fsdp=2", "--format", "json"))
    streams = {p["stream"] for p in doc["memory"]["reserved"]["by_pool_stream"]}
    assert {"default", ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM} <= streams, streams
    nccl = [f for f in doc["memory"]["fixed"] if f["name"].startswith("NCCL")]
    assert len(nccl) == 1 and nccl[0]["bytes"] == 2 * 4 * MiB and not nccl[0]["inside_reserved"]
    text = run("profile", *MLP, "--gpu", "h100", "--mesh", "fsdp=2", "--summary")
    assert "reserved    per rank: peak" in text, text


def test_alloc_conf_reaches_the_replay_and_bad_values_are_usage_errors(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    doc = json.loads(run("profile", *MLP, "--gpu", "h100", "--no-max-batch", "--alloc-conf",
                         "expandable_segments:True", "--format", "json"))
    assert doc["memory"]["reserved"]["alloc_conf"] == "expandable_segments:True"
    assert doc["memory"]["reserved"]["expandable_segments"] is True
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    doc = json.loads(run("profile", *MLP, "--gpu", "h100", "--no-max-batch", "--format", "json"))
    assert doc["memory"]["reserved"]["expandable_segments"] is True  # from the environment
    result = CliRunner().invoke(cli, ["profile", *MLP, "--gpu", "h100", "--alloc-conf", "expandable_segments:yes"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--alloc-conf" in lines[0] and "True or False" in lines[0], lines
    with pytest.raises(UsageError, match="unknown key"):
        Config(alloc_conf="nope:1")
    # a bad value in the environment stops a GPU profile (exit 2, naming the variable), not a CPU one
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "nope:1")
    assert Config().alloc_conf is None
    result = CliRunner().invoke(cli, ["profile", *MLP, "--gpu", "h100"])
    assert result.exit_code == 2 and "PYTORCH_CUDA_ALLOC_CONF: unknown key 'nope'" in result.stderr, result.output
