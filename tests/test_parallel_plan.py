"""`fxacct plan`: layouts that divide the GPUs and the batch, rejected by exact bounds before any
trace, screened from two short traces (extrapolated in the number of blocks, held equal to a full
trace here), the best confirmed by a full trace, ranked by predicted throughput."""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace

import pytest
import torch
from click.testing import CliRunner
from helpers import target

import fxacct
from fxacct import devices
from fxacct.load.source import load_model
from fxacct.parallel.profile import profile_parallel
from fxacct.predict.fused_time import predict_profile
from fxacct.report.plan_text import plan_json
from fxacct.tools.plan import plan
from fxacct.tools.plan_layouts import Layout, enumerate_layouts
from fxacct.tools.plan_screen import extrapolate, point, truncate, truncated_loader
from fxacct_cli.main import cli

LLAMA = target("examples/llama.py:Llama")
PARALLELIZE = target("examples/llama.py:parallelize")


def llama(mesh="fsdp=8", **kw) -> fxacct.Config:
    return fxacct.Config(target=LLAMA, gpu="h100", mesh=mesh, parallelize=PARALLELIZE, find_max_batch=False, **kw)


def test_layouts_divide_gpus_and_batch():
    """8 GPUs on 8-GPU nodes: tp ∈ {1, 2, 4, 8}, fsdp = 8 / tp; global batch 16 over the fsdp ranks:
    16/8 = 2, 16/4 = 4, 16/2 = 8, 16/1 = 16 per rank, each split into every divisor as micro-batch,
    checkpointing off and on: (2 + 3 + 4 + 5) × 2 = 28 layouts."""
    lays = enumerate_layouts(8, 16, 8, pipeline=False)
    assert len(lays) == 28
    assert [(x.micro_batch, x.accumulation) for x in lays if x.mesh == "fsdp=2,tp=4" and not x.checkpoint] == \
        [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert {x.mesh for x in lays} == {"fsdp=8", "fsdp=4,tp=2", "fsdp=2,tp=4", "tp=8"}
    assert {x.micro_batch for x in enumerate_layouts(8, 12, 8, False) if x.mesh == "fsdp=8"} == {0}  # 12 / 8
    assert [x.mesh for x in enumerate_layouts(16, 16, 4, False) if x.micro_batch == 1 and not x.checkpoint] == \
        ["fsdp=16", "fsdp=8,tp=2", "fsdp=4,tp=4"]  # tp within a node of 4
    # with a pipeline split, 4 GPUs: pp ∈ {1, 2, 4} × tp dividing what is left
    assert {x.mesh for x in enumerate_layouts(4, 4, 8, True)} == {
        "fsdp=4", "fsdp=2,tp=2", "tp=4", "pp=2,fsdp=2", "pp=2,tp=2", "pp=4"}


def test_truncate_keeps_the_first_blocks_of_any_container():
    seq = torch.nn.Sequential(torch.nn.Embedding(4, 2), *[torch.nn.Linear(2, 2) for _ in range(5)], torch.nn.ReLU())
    truncate(seq, 3)
    assert [type(m).__name__ for m in seq] == ["Embedding", "Linear", "Linear", "Linear", "ReLU"]
    assert [n for n, _ in seq.named_children()] == ["0", "1", "2", "3", "4"]
    model = load_model(fxacct.Config(target=LLAMA, kwargs={"n_layers": 5}))[0]  # layers: a ModuleDict
    truncate(model, 2)
    assert list(model.layers) == ["0", "1"] and model.output is not None


@pytest.mark.slow  # a screen and a full trace per mesh; test_plan_cli_table_fits_the_width_and_json stays fast
@pytest.mark.parametrize("mesh,ckpt", [("fsdp=4", ()), ("fsdp=2,tp=2", ("layers.*",))])
def test_screen_extrapolates_exactly_to_a_full_trace(mesh, ckpt):
    """The oracle is a full trace of the 6-block model: every integer of one rank's account
    (peak, FLOPs, bytes, collective bytes) is equal; the predicted times equal up to rounding.
    What the rank needs of the GPU (reserved at its peak plus the fixed costs) is not a line in the
    blocks (the allocator rounds to blocks and segments): the screen's is the extrapolated peak plus
    the fixed costs, at most the full trace's reserved plus those costs."""
    cfg = llama(mesh, kwargs={"n_layers": 6}, batch=2, checkpoint=ckpt)
    full = point(profile_parallel(cfg, with_inference=False))
    a = point(profile_parallel(cfg, truncated_loader(3), with_inference=False))
    b = point(profile_parallel(cfg, truncated_loader(4), with_inference=False))
    got = extrapolate(a, b, 3, 6)
    assert full.fixed_bytes > 400 * 2**20  # the CUDA context and NCCL's buffers (fxacct.memory.fixed)
    assert got.fit_bytes == full.peak_bytes + full.fixed_bytes < full.fit_bytes
    for f in fields(got):
        want, have = getattr(full, f.name), getattr(got, f.name)
        if f.name == "fit_bytes":
            continue
        if isinstance(want, int):
            assert have == want, f.name
        else:
            assert math.isclose(have, want, rel_tol=1e-9), f.name
    assert a.peak_bytes < full.peak_bytes  # the extrapolation is not the trivial one


@pytest.mark.slow  # screens and full traces; test_plan_cli_table_fits_the_width_and_json stays fast
def test_screen_peak_is_a_lower_bound_where_the_peak_moves():
    """Under autocast with checkpointing, the 10-block peak is reached at a moment that grows faster
    per block than the moment of the 3- and 4-block peaks: the extrapolated peak is below the full
    trace's (the oracle), the FLOPs still equal."""
    cfg = llama("fsdp=4", kwargs=dict(n_layers=10, dim=256, hidden=512, vocab_size=1000, max_seq=128), batch=2,
                amp=torch.bfloat16, checkpoint=("layers.*",))
    full = point(profile_parallel(cfg, with_inference=False))
    a = point(profile_parallel(cfg, truncated_loader(3), with_inference=False))
    b = point(profile_parallel(cfg, truncated_loader(4), with_inference=False))
    got = extrapolate(a, b, 3, 10)
    assert got.peak_bytes < full.peak_bytes and got.model_flops == full.model_flops


def test_parameters_alone_reject_before_any_trace(monkeypatch):
    """The small Llama (vocab 512, dim 64, 2 blocks, 4 heads, 2 kv heads, hidden 128) has
    512·64 (embedding) + 2 × (64 + 64·64 + 2·64·32 + 64·64 + 64 + 3·64·128) (blocks: 36,992 each)
    + 64 (norm) + 512·64 (output) = 139,584 parameters, 558,336 B in fp32: 69,792 B per GPU of 8."""
    monkeypatch.setitem(devices.DEVICES, "h100", replace(devices.DEVICES["h100"], capacity_reported=60_000))
    result = plan(llama(), 8, 16)
    assert result.traces == 0
    why = {c.mesh: c.rejected for c in result.candidates}
    assert why["fsdp=8"] == "over memory by at least 9.56 KiB: parameters alone, 69,792 B per GPU"
    assert why["fsdp=2,tp=4"].startswith("tp=4 does not divide the model's n_kv_heads=2")  # heads come first
    assert len(result.candidates) == 4  # one row per mesh: no reason depends on the micro-batch


@pytest.mark.slow  # traces every layout, then confirms the best
def test_plan_ranks_fitting_layouts_and_confirms_the_best(monkeypatch):
    """A GPU of 1 GiB for a 5-block Llama (width 256, hidden 1024, 2,048 tokens) on 8 GPUs, global
    batch 16: the best layout's figures are those of a full profile of its mesh and micro-batch (the
    oracle: fxacct.profile), and a layout is judged as ``fxacct check --gpu`` judges it: by the
    allocator's reserved peak plus the fixed costs outside it (400 MiB of CUDA context, NCCL's
    buffers), not by the tensors' peak, which is below the GPU for a layout over it."""
    capacity = 2**30
    monkeypatch.setitem(devices.DEVICES, "h100", replace(devices.DEVICES["h100"], capacity_reported=capacity))
    shape = {"n_layers": 5, "dim": 256, "n_heads": 4, "hidden": 1024, "max_seq": 2048}
    result = plan(llama(kwargs=shape), 8, 16)
    cands = result.candidates
    fit = [c for c in cands if c.fits]
    assert fit and cands[0] is fit[0] and fit[0].source == "traced"
    assert [c.tokens_per_s for c in fit] == sorted((c.tokens_per_s for c in fit), reverse=True)
    top = fit[0]
    prof = fxacct.profile(llama(top.mesh, kwargs=shape, batch=top.micro_batch,
                                checkpoint=("layers.*",) if top.layout.checkpoint else ()))
    extra = prof.memory.grad_bytes if top.layout.accumulation > 1 else 0
    assert top.peak_bytes == prof.memory.rank_peak.bytes + extra
    assert top.fit_bytes == prof.memory.reserved.fit_bytes + extra <= capacity
    # a micro-steps of forward and backward, one optimizer step: the optimizer's ops (their roofline
    # times, summed from fxacct's own prediction of the profile) count once
    a, t = top.layout.accumulation, prof.parallel.time
    optimizer_s = sum(op.seconds for op in predict_profile(prof).ops if op.phase == "optimizer")
    assert optimizer_s > 0 and math.isclose(t.optimizer_s, optimizer_s, rel_tol=1e-12)
    assert math.isclose(top.step_s, a * (t.step_s - optimizer_s) + optimizer_s, rel_tol=1e-12)
    why = {(c.mesh, c.micro_batch, c.layout.checkpoint): c.rejected or c.dominated for c in cands if not c.fits}
    assert why[("fsdp=2,tp=4", 0, False)].startswith("tp=4 does not divide the model's n_kv_heads=2")
    over = [c for c in cands if c.over_memory and c.peak_bytes is not None]
    assert over and all(c.fit_bytes > capacity and c.over_bytes == c.fit_bytes - capacity for c in over)
    assert any(c.peak_bytes < capacity for c in over)  # the tensors alone would fit: the allocator's rounding and
    # the fixed costs do not
    doc = plan_json(result)
    assert [lay["rank"] for lay in doc["layouts"][:len(fit)]] == list(range(1, len(fit) + 1))
    assert all(lay["fits"] == (lay["rejected"] is None) for lay in doc["layouts"])  # a dominated layout fits
    assert any(lay["fits"] and lay["rank"] is None for lay in doc["layouts"])
    # the tp=4 mesh, rejected before any micro-batch: one entry, its micro-batch figures null (they were 0)
    (tp4,) = [lay for lay in doc["layouts"] if lay["mesh"] == "fsdp=2,tp=4"]
    assert (tp4["micro_batch"], tp4["micro_batches_per_step"], tp4["checkpoint"]) == (None, None, None), tp4


def test_plan_pipeline_layouts_carry_the_bubble():
    """With --pp-split, pp=2 layouts are planned; the step is (M + P − 1) × the slowest stage's
    micro-step, then one optimizer step: pp=2,fsdp=2 at global batch 4 has 2 examples per rank,
    micro-batch 1, M = 2."""
    cfg = replace(llama(pp_split=target("examples/llama.py:pipeline_stage")), mesh="fsdp=4")
    cands = plan(cfg, 4, 4, confirm_top=0).candidates
    pipe = {(c.micro_batch, c.layout.checkpoint): c for c in cands if c.mesh == "pp=2,fsdp=2" and c.step_s}
    assert pipe, [(c.mesh, c.rejected) for c in cands]
    c = next(iter(pipe.values()))
    m = c.layout.accumulation
    stages = fxacct.profile(llama("pp=2,fsdp=2", batch=c.micro_batch, microbatches=m,
                                  pp_split=cfg.pp_split, checkpoint=("layers.*",) if c.layout.checkpoint else ())
                            ).parallel.pipeline.stages
    # the micro-steps' slowest (its optimizer left out) (M + P − 1) times, then one optimizer step
    times = [s.profile.parallel.time for s in stages]
    slowest = max(t.step_s - t.optimizer_s for t in times)
    assert all(t.optimizer_s > 0 for t in times)
    assert math.isclose(c.step_s, (m + 2 - 1) * slowest + max(t.optimizer_s for t in times), rel_tol=1e-12)
    # the stage peaks already replay all M micro-batches, gradients included (held against the real
    # pipelining run in test_parallel_gloo): the layout's peak is the largest, nothing added
    assert c.peak_bytes == max(s.peak_bytes for s in stages)
    # pp=2,fsdp=2 at micro-batch 2 has M = 4 / (2 · 2) = 1 micro-batch per step: 1F1B needs 2; the
    # reason names no flag (the planner chose M, not the user)
    few = [x for x in cands if x.mesh == "pp=2,fsdp=2" and x.micro_batch == 2]
    assert few and all(x.rejected == "1 micro-batch per step, fewer than the 2 stages 1F1B needs "
                       "(a smaller micro-batch makes more)" for x in few)
    # checkpointing where the same micro-batch fits without it only adds the recompute: not ranked,
    # for a pipeline as for the other meshes (the pipeline's was ranked below its twin)
    assert c.layout.checkpoint is False and not any(x.layout.checkpoint for x in pipe.values())
    (on,) = [x for x in cands if x.mesh == "pp=2,fsdp=2" and x.micro_batch == 1 and x.layout.checkpoint]
    assert on.dominated == "slower than ckpt off at mb 1" and on.source == "-", on


def test_plan_cli_table_fits_the_width_and_json():
    args = ["plan", LLAMA, "--gpus", "4", "--gpu", "h100", "--global-batch", "8", "--parallelize", PARALLELIZE]
    r = CliRunner().invoke(cli, args, catch_exceptions=False, env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("fxacct plan: 4 × h100, global batch 8, 2 repeated blocks; ")
    assert max(len(line) for line in lines[1:]) <= 80
    ranked = [line.split()[1] for line in lines[3:] if line.split()[0].isdigit()]
    assert set(ranked) == {"fsdp=2,tp=2", "fsdp=4"}
    r = CliRunner().invoke(cli, args + ["--format", "json"], catch_exceptions=False)
    doc = json.loads(r.stdout)
    assert doc["schema"] == "fxacct.plan/1"
    assert doc["blocks"] == 2 and doc["layouts"][0]["fits"] and doc["layouts"][0]["source"] == "traced"
    assert {row["mesh"] for row in doc["layouts"]} == {"fsdp=4", "fsdp=2,tp=2", "tp=4"}


def test_layout_mesh_names():
    assert Layout(1, 1, 8, 1, 1, False).mesh == "tp=8"
    assert Layout(2, 4, 1, 1, 1, False).mesh == "pp=2,fsdp=4"


def test_mesh_profile_applies_checkpointing():
    """Under --mesh, --checkpoint 'layers.*' wraps the blocks as on one device: FSDP2 shards
    parameters, not work, so the backward re-runs exactly the recompute FLOPs of the single-device
    profile with the same flag (the oracle: no mesh, no fake process group), and fewer activation
    bytes are saved than without it."""
    plain = fxacct.profile(llama("fsdp=2", batch=2))
    ckpt = fxacct.profile(llama("fsdp=2", batch=2, checkpoint=("layers.*",)))
    single = fxacct.profile(fxacct.Config(target=LLAMA, batch=2, checkpoint=("layers.*",)))
    assert ckpt.accounting.totals.recompute_flops == single.accounting.totals.recompute_flops > 0
    assert ckpt.accounting.totals.activation_bytes < plain.accounting.totals.activation_bytes


def test_tensor_parallel_recompute_is_not_model_flops():
    """Under tp=2 with --checkpoint 'layers.*', DTensor's ops that checkpointing re-runs in the
    backward are recompute, as on one device: model FLOPs equal the same mesh's without
    checkpointing (the oracle: a trace with no recompute at all), and the recompute is counted
    apart. They were model FLOPs once (a DTensor op's grad_fn number was consumed by the detach
    that packs its saved inputs), which made the plan's MFU of checkpointed tp layouts 22% high."""
    plain = fxacct.profile(llama("fsdp=2,tp=2", batch=2))
    ckpt = fxacct.profile(llama("fsdp=2,tp=2", batch=2, checkpoint=("layers.*",)))
    assert ckpt.accounting.totals.model_flops == plain.accounting.totals.model_flops
    assert ckpt.accounting.totals.recompute_flops > 0 == plain.accounting.totals.recompute_flops
    assert ckpt.parallel.throughput.mfu < plain.parallel.throughput.mfu  # the same work in a longer step


def test_confirm_falls_back_to_a_smaller_micro_batch_when_the_full_trace_is_over():
    """The screen's peak is a lower bound: when the full trace of the screen's best layout is over
    memory, it is rejected and the next smaller micro-batch of its group is traced in full."""
    from fxacct.tools.plan import Candidate, confirm

    lays = [Layout(1, 8, 1, mb, 4 // mb, True) for mb in (1, 2, 4)]
    other = Layout(1, 4, 2, 4, 1, True)
    out = {lays[0]: Candidate(lays[0], dominated="slower than mb 4"),
           lays[1]: Candidate(lays[1], dominated="slower than mb 4"),
           lays[2]: Candidate(lays[2], 70, 1.0, 400.0, source="screen"),
           other: Candidate(other, 60, 2.0, 200.0, source="screen")}

    class Stub:  # full traces: micro-batch 4 is over (peak 90 > 80), micro-batch 2 fits
        def probe(self, lay, full=False):
            assert full
            if lay.micro_batch == 4:
                return Candidate(lay, 90, 1.0, 400.0, source="traced", rejected="over memory by 10 B", over_bytes=10)
            return Candidate(lay, 50, 1.2, 300.0, source="traced")

    confirm(Stub(), out, 1)
    assert out[lays[2]].over_memory and out[lays[1]].fits and out[lays[1]].source == "traced"
    assert out[lays[0]].dominated == "slower than mb 2" and out[other].source == "screen"


def test_every_pipeline_micro_batch_is_judged_on_its_own():
    """pp=2,fsdp=2 at global batch 8: each fsdp rank has 4 examples, so micro-batches 1, 2, 4 run
    M = 4, 2, 1 micro-batches. M = 1 is fewer than the 2 stages (rejected before any trace, in the
    plan's terms); micro-batch 2 (M = 2) is traced, not rejected with micro-batch 4's reason as it
    once was."""
    cfg = replace(llama(pp_split=target("examples/llama.py:pipeline_stage")), mesh="fsdp=4")
    cands = {c.micro_batch: c for c in plan(cfg, 4, 8, confirm_top=0).candidates
             if c.mesh == "pp=2,fsdp=2" and not c.layout.checkpoint}
    assert cands[4].rejected.startswith("1 micro-batch per step, fewer than the 2 stages 1F1B needs")
    assert cands[2].step_s is not None and cands[1].step_s is not None, cands
    assert cands[2].rejected is None or "over memory" in cands[2].rejected, cands[2]


def test_a_pipeline_alone_gets_no_parallelize_function():
    """With --parallelize, a pp=4 layout of 4 GPUs has no fsdp or tp for the function to shard
    over: its config drops it (as a profile of --mesh pp=4 --parallelize is refused), so the plan
    judges the layout instead of stopping on a usage error; pp=2,fsdp=2 keeps it."""
    from fxacct.tools.plan import Planner

    planner = Planner(llama(kwargs={"n_layers": 4}, pp_split=target("examples/llama.py:pipeline_stage")), 4, 4)
    alone = planner.layout_config(Layout(pp=4, fsdp=1, tp=1, micro_batch=1, accumulation=4, checkpoint=False))
    assert str(alone.mesh) == "pp=4" and alone.parallelize is None
    inner = planner.layout_config(Layout(pp=2, fsdp=2, tp=1, micro_batch=1, accumulation=2, checkpoint=False))
    assert str(inner.mesh) == "pp=2,fsdp=2" and inner.parallelize == PARALLELIZE


@pytest.mark.parametrize("flags,says", [
    (["--mesh", "fsdp=2"], "chooses --mesh for each layout"),  # it was accepted and ignored
    (["--batch", "4"], "chooses --batch for each layout"),
    (["--microbatches", "2"], "chooses --microbatches for each layout"),
    (["--gpus", "0"], "--gpus must be at least 2"),  # it named a --mesh 'fsdp=0' nobody gave
    (["--world-size", "4"], "chooses --world-size for each layout"),  # it named a --mesh nobody gave
    (["--shard", "zero3"], "chooses --shard for each layout"),  # it asked for a --world-size, then refused that
    (["--checkpoint", "nomatch.*"], "--checkpoint 'nomatch.*' matches no module"),  # it exited 0, rows rejected
    (["--no-max-batch"], "searches for no largest batch"),  # it was accepted and ignored
    (["--zero1"], "shard the optimizer state already: drop --zero1"),  # it named a --mesh fsdp=4 nobody gave
])
def test_plan_flags_it_chooses_itself_are_usage_errors(flags, says):
    args = ["plan", target("examples/gpt2.py:GPT"), "--gpus", "4", "--gpu", "h100", "--global-batch", "8", *flags]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, (r.stdout, r.stderr)


def test_a_plan_where_no_layout_fits_says_so_and_exits_1():
    # 3 GPUs, global batch 16: 16 does not divide over 3 ranks and tp=3 not over 4 heads, so every layout
    # is rejected before any trace; the plan printed its table and exited 0, no line saying nothing fits
    args = ["plan", LLAMA, "-k", "n_layers=2", "--gpus", "3", "--gpu", "h100", "--global-batch", "16", "--no-cache",
            "--format", "json"]
    r = CliRunner().invoke(cli, args)
    doc = json.loads(r.stdout)
    assert doc["layouts"] and not any(lay["fits"] for lay in doc["layouts"])
    assert r.exit_code == 1, (r.stdout, r.stderr)
    line, = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: no layout of 3 GPUs fits at global batch 16"), r.stderr
