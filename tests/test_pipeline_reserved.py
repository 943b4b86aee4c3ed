"""--mesh pp=P on a CUDA target: each rank's whole step, in the schedule's order, replayed through
the caching allocator (fxacct.parallel.pipeline_memory.AllocatorMirror), and the fit, the JSON,
``fxacct check`` and ``fxacct plan`` judging the rank that needs the most of its GPU.

Oracles: the allocator's allocated bytes against an independent count of the same walk's blocks
rounded as CUDACachingAllocator.cpp's round_size rounds them (kMinBlockSize 512; every tensor of
this small Llama is under 1 MiB, so each lives in a small-pool block of exactly that size, and the
32 MiB cuBLAS workspace in a large block of exactly 32 MiB); the fixed costs from their sourced
constants (400 MiB of CUDA context, 8 MiB of NCCL buffers per communicator: one per mesh
dimension, pp's included)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import target

import fxacct
from fxacct.parallel import pipeline_memory
from fxacct.tools.plan import plan
from fxacct_cli.main import cli

MiB = 2**20
SPLIT = "examples/llama.py:pipeline_stage"
PARALLELIZE = "examples/llama.py:parallelize"


def _config(mesh="pp=2,fsdp=2", schedule="1f1b", gpu="h100", microbatches=2):
    """examples/llama.py at 4 blocks, micro-batch 1, two micro-batches a step."""
    return fxacct.Config(target=target("examples/llama.py:Llama"), batch=1, kwargs={"n_layers": 4}, mesh=mesh,
                         parallelize=target(PARALLELIZE) if "fsdp" in mesh else None, pp_split=target(SPLIT),
                         microbatches=microbatches, pp_schedule=schedule, gpu=gpu, find_max_batch=False)


class _RoundedBlocks:
    """The walk's allocations counted as the allocator rounds them: max(512, ⌈size / 512⌉ · 512), one
    steady step's (every resident block from the start: a run's later steps, which allocate the most)."""

    def __init__(self):
        self.live, self.now, self.peak = {}, 0, 0

    def _add(self, key, nbytes):
        size = max(512, -(-nbytes // 512) * 512)
        self.live[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)

    def resident(self, blocks, first_step_made=()):
        for i, nbytes in enumerate(blocks):
            if nbytes:
                self._add(("resident", i), nbytes)

    def made(self, blocks):
        pass  # resident from the start here

    def malloc(self, key, nbytes):
        if nbytes:
            self._add(key, nbytes)

    def free(self, key, nbytes):
        if nbytes:
            self.now -= self.live.pop(key)


@pytest.mark.parametrize("mesh,schedule", [("pp=2,fsdp=2", "1f1b"), ("pp=2", "gpipe"),
                                           ("pp=2,fsdp=2", "interleaved-1f1b")])
def test_each_rank_is_replayed_through_the_allocator(monkeypatch, mesh, schedule):
    counts = []

    def counted(stages, actions, microbatches, releases, allocator=None, prep=None):
        if allocator is None:  # the op-level walk of the account
            return original(stages, actions, microbatches, releases)
        if allocator.step:  # a run's later steps: the first one is checked
            return original(stages, actions, microbatches, releases, allocator, prep)
        oracle = _RoundedBlocks()
        peak = original(stages, actions, microbatches, releases, oracle)
        assert original(stages, actions, microbatches, releases, allocator, prep) == peak  # the mirror changes no peak
        counts.append((oracle.peak, peak))
        return peak

    original = pipeline_memory.stage_peak
    monkeypatch.setattr("fxacct.parallel.pipeline.stage_peak", counted)
    pipe = fxacct.profile(_config(mesh, schedule)).parallel.pipeline
    assert len(counts) == len(pipe.stages) == 2
    for stage, (blocks, peak) in zip(pipe.stages, counts):
        r = stage.reserved
        assert peak == stage.peak_bytes  # the walk again, as the account walked it
        # the cuBLAS workspaces (32 MiB on compute capability 9.0) of the forward's and the backward's threads
        assert r.peak_allocated_bytes == blocks + 2 * 32 * MiB
        assert blocks >= stage.peak_bytes  # rounding only adds
        assert r.peak_reserved_bytes >= r.peak_allocated_bytes and r.peak_reserved_bytes % (2 * MiB) == 0
        dims = mesh.count("=")
        assert r.fixed_outside_bytes == 400 * MiB + dims * 8 * MiB
        assert r.fit_bytes == r.peak_reserved_bytes + r.fixed_outside_bytes
    assert pipe.largest_reserved.fit_bytes == max(s.reserved.fit_bytes for s in pipe.stages)


def test_profile_check_and_plan_judge_the_rank_that_needs_most():
    """The fit, JSON's memory.reserved and fit, fxacct check's memory budget and fxacct plan's row of
    the same layout all carry the largest rank's reserved + fixed; without --gpu the op-level peak."""
    prof = fxacct.profile(_config())
    need = prof.parallel.pipeline.largest_reserved.fit_bytes
    assert prof.memory.reserved.fit_bytes == prof.memory.fit.peak_bytes == need
    assert prof.memory.fit.basis == "peak_reserved_bytes + fixed (the largest rank's step)"
    assert need > prof.parallel.pipeline.peak_bytes + 400 * MiB
    args = ["examples/llama.py:Llama", "-k", "n_layers=4", "--batch", "1", "--mesh", "pp=2,fsdp=2", "--parallelize",
            PARALLELIZE, "--pp-split", SPLIT, "--microbatches", "2", "--gpu", "h100"]
    doc = json.loads(CliRunner().invoke(cli, ["profile", *args, "--format", "json"]).stdout)
    assert doc["memory"]["reserved"]["fit_bytes"] == doc["memory"]["fit"]["peak_bytes"] == need
    r = CliRunner().invoke(cli, ["check", *args, "--format", "json"])
    assert r.exit_code == 0, r.output
    memory = [b for b in json.loads(r.stdout)["budgets"] if b["name"] == "memory"]
    assert memory and memory[0]["value"] == need and "largest rank" in memory[0]["figure"]
    base = fxacct.Config(target=target("examples/llama.py:Llama"), kwargs={"n_layers": 4}, mesh="fsdp=4", gpu="h100",
                         parallelize=target(PARALLELIZE), pp_split=target(SPLIT), find_max_batch=False)
    # 4 GPUs, global batch 4: pp=2,fsdp=2 has 2 examples a rank, micro-batch 1 in 2 micro-batches
    row = [c for c in plan(base, 4, 4, confirm_top=0).candidates if c.mesh == "pp=2,fsdp=2" and c.micro_batch == 1
           and c.layout.accumulation == 2 and c.layout.checkpoint is False]
    assert row and row[0].fit_bytes == need and row[0].peak_bytes == prof.parallel.pipeline.peak_bytes
    cpu = fxacct.profile(_config(gpu=None))
    assert cpu.memory.reserved is None and cpu.memory.fit is None
    assert all(s.reserved is None for s in cpu.parallel.pipeline.stages)


def test_plan_replays_no_pipeline_already_over_at_its_peak(monkeypatch):
    """A full pipeline trace whose peak plus fixed costs is over the GPU is rejected on that lower
    bound ("at least"), with no replay through the allocator; one under it is replayed."""
    from dataclasses import replace

    from fxacct import devices
    from fxacct.parallel import pipeline

    pipe = fxacct.profile(_config()).parallel.pipeline
    bound = pipe.peak_bytes + pipe.fixed_outside_bytes
    assert pipe.fixed_outside_bytes == (400 + 2 * 8) * MiB
    replayed = []
    original = pipeline._rank_reserved

    def noted(config, *args):
        replayed.append((str(config.mesh), config.batch, config.microbatches, bool(config.checkpoint)))
        return original(config, *args)

    monkeypatch.setattr(pipeline, "_rank_reserved", noted)
    monkeypatch.setitem(devices.DEVICES, "h100", replace(devices.DEVICES["h100"], capacity_reported=bound - 1))
    base = fxacct.Config(target=target("examples/llama.py:Llama"), kwargs={"n_layers": 4}, mesh="fsdp=4", gpu="h100",
                         parallelize=target(PARALLELIZE), pp_split=target(SPLIT), find_max_batch=False)
    cands = plan(base, 4, 4, confirm_top=0).candidates
    row = [c for c in cands if c.mesh == "pp=2,fsdp=2" and c.micro_batch == 1 and c.layout.accumulation == 2
           and c.layout.checkpoint is False]
    assert row and row[0].rejected == "over memory by at least 1 B (1.00×)" and row[0].fit_bytes == bound
    assert ("pp=2,fsdp=2", 1, 2, False) not in replayed
    assert ("pp=2,fsdp=2", 1, 2, True) in replayed  # checkpointing on: a lower peak, under the bound, replayed


def test_the_whole_model_and_the_whole_step_under_pp():
    """The report under pp is stage 0's one micro-batch, but N and the tokens per second are the
    job's: the example Llama's 139,584 parameters at its defaults (counted by hand in
    tests/test_parallel_plan.py; it said stage 0's 69,760), and every micro-batch through the
    schedule (it gave stage 0's micro-batch rate, about 1.5× the summary's per pipeline): at
    pp=2,fsdp=2, micro-batch 2 of 64 tokens, 2 micro-batches, 4 GPUs make 2 pipelines."""
    import math

    cfg = fxacct.Config(target=target("examples/llama.py:Llama"), batch=2, mesh="pp=2,fsdp=2",
                        parallelize=target(PARALLELIZE), pp_split=target(SPLIT), microbatches=2, gpu="h100",
                        find_max_batch=False)
    par = fxacct.profile(cfg).parallel
    pipe, th = par.pipeline, par.throughput
    assert (par.model_params, par.model_frozen_params) == (139_584, 0)
    per_pipeline = 2 * 2 * 64 / pipe.step_s
    assert math.isclose(th.tokens_per_s_job, 2 * per_pipeline, rel_tol=1e-12)
    assert math.isclose(th.tokens_per_s_gpu, 2 * per_pipeline / 4, rel_tol=1e-12)
    stage_flops = sum(s.profile.accounting.totals.model_flops for s in pipe.stages)
    peak = fxacct.devices.get_device("h100").matmul_peak(torch.float32)
    assert math.isclose(th.mfu, 2 * stage_flops / 2 / pipe.step_s / peak, rel_tol=1e-12)


def test_the_mirror_replays_a_run_whose_first_step_makes_the_optimizer_state():
    """AllocatorMirror over two steps of a rank, by hand (H100 defaults, MiB): resident W 16 and the
    optimizer state 16, which the first step makes at its optimizer phase. Step 1: an activation of 32
    is a new segment A (48 reserved with W), freed; a gradient of 16 splits A; the state takes A's free
    half; the step's end drops the gradient. Step 2: the activation finds no free block of 32 (A holds
    the state): a new segment, 80; the gradient takes A's freed half. Step 3 reserves nothing new.
    With the state resident from the start, as one steady step has it, the same walk reserves 64."""
    from fxacct.memory.allocator import CachingAllocator
    from fxacct.memory.reserved import until_steady

    def replay(first_step_made):
        allocator = CachingAllocator()
        mirror = pipeline_memory.AllocatorMirror(allocator, {})

        def run_step(step):
            mirror.resident([16 * MiB, 16 * MiB], first_step_made)
            mirror.malloc(("a", (0, 0)), 32 * MiB)
            mirror.free(("a", (0, 0)), 32 * MiB)
            mirror.malloc(("g", (0, 0)), 16 * MiB)  # kept to the step's end, as gradients are
            mirror.made([(i, 16 * MiB) for i in first_step_made])
            mirror.end_step()

        return until_steady(allocator, run_step), allocator.result().peak_reserved_bytes

    assert replay({1}) == (3, 80 * MiB)
    assert replay(set()) == (2, 64 * MiB)
