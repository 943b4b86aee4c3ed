"""`fxacct plan` answering fast without changing an answer: a traced layout's figures are a plain
profile's of that layout (tensor-parallel and pipeline layouts included), a trace read back from
the disk cache or taken from an identical pipeline stage gives the same figures as a fresh one,
a pipeline screen is exact in FLOPs and a lower bound in peak, and the counts add up."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner
from helpers import target

import fxacct
from fxacct import devices
from fxacct.parallel.pipeline import profile_pipeline
from fxacct.tools.plan import plan
from fxacct.tools.plan_screen import pipe_point, screen_pipeline
from fxacct_cli.main import cli

LLAMA = target("examples/llama.py:Llama")
PARALLELIZE = target("examples/llama.py:parallelize")
STAGE = target("examples/llama.py:pipeline_stage")


def llama(mesh="fsdp=4", **kw) -> fxacct.Config:
    return fxacct.Config(target=LLAMA, gpu="h100", mesh=mesh, parallelize=PARALLELIZE, find_max_batch=False,
                         loss="cross-entropy", **kw)


def _profile_of(c, cfg) -> tuple[int, int]:
    """(peak bytes, model FLOPs of one step) of a plain profile of the candidate's layout: the
    oracle. A step of A micro-batches is A micro-steps; without pp the gradients are added to
    the peak when A > 1 (fxacct.tools.plan's docstring); with pp the stages' FLOPs are summed."""
    lay = c.layout
    prof = fxacct.profile(replace(cfg, mesh=lay.mesh, batch=lay.micro_batch,
                                  parallelize=cfg.parallelize if lay.fsdp * lay.tp > 1 else None,
                                  checkpoint=("layers.*",) if lay.checkpoint else (),
                                  microbatches=lay.accumulation if lay.pp > 1 else None,
                                  pp_split=cfg.pp_split if lay.pp > 1 else None))
    if lay.pp > 1:
        pipe = prof.parallel.pipeline
        return pipe.peak_bytes, lay.accumulation * sum(s.profile.accounting.totals.model_flops for s in pipe.stages)
    extra = prof.memory.grad_bytes if lay.accumulation > 1 else 0
    return prof.memory.rank_peak.bytes + extra, lay.accumulation * prof.accounting.totals.model_flops


@pytest.mark.slow  # a plan of every layout of 4 GPUs, then a profile of each traced one
def test_traced_layouts_equal_a_plain_profile_tp_and_pp():
    """4 GPUs, global batch 4, a 4-block Llama (4 heads, 2 kv heads) with --pp-split: every traced
    layout's peak and FLOPs (tp=2 and pp=2 among them) equal `fxacct profile --mesh` of it. (AdamW
    without foreach: under tp alone this model's norms stay plain tensors, which a foreach step
    refuses to mix with DTensors, as on a GPU; pp=2,tp=2 would be rejected, not traced.)"""
    cfg = llama(kwargs={"n_layers": 4}, pp_split=STAGE, optim_args={"foreach": False})
    result = plan(cfg, 4, 4, confirm_top=0)
    traced = [c for c in result.candidates if c.source == "traced" and c.peak_bytes is not None]
    meshes = {c.mesh for c in traced}
    assert {"fsdp=2,tp=2", "pp=2,fsdp=2", "pp=2,tp=2"} <= meshes, meshes
    for c in traced:
        assert (c.peak_bytes, c.model_flops) == _profile_of(c, cfg), c


def test_a_trace_read_back_from_disk_gives_the_same_plan(tmp_path):
    """The same plan twice with one cache dir: the second runs no trace (every probe reused), and
    every figure of every layout is the same, floats included."""
    cfg = llama(kwargs={"n_layers": 2})
    first = plan(cfg, 4, 4, cache_dir=tmp_path)
    second = plan(cfg, 4, 4, cache_dir=tmp_path)
    assert first.traced > 0 and first.reused == 0
    assert second.traced == 0 and second.reused == first.traced
    assert second.candidates == first.candidates
    assert len(list(tmp_path.glob("*.json"))) == first.traces
    # another Config (a different dtype) is another trace: nothing read back
    assert plan(replace(cfg, dtype="bf16"), 4, 4, cache_dir=tmp_path).reused == 0


def test_identical_pipeline_stages_reuse_a_proven_trace(monkeypatch):
    """pp=5 over fsdp=2 of a 5-block Llama cut one block a stage: stages 1, 2 and 3 share a shape;
    stages 1 and 2 are traced and agree, stage 3 takes stage 2's account. Every rank's peak, each
    stage's FLOPs and times equal those of the pipeline traced stage by stage."""
    from fxacct.parallel import pipeline

    cfg = llama("pp=5,fsdp=2", kwargs={"n_layers": 5}, pp_split=STAGE, microbatches=5)
    calls = []
    real = pipeline._profile_stage
    monkeypatch.setattr(pipeline, "_profile_stage", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    reused = profile_pipeline(cfg, reuse_stages=True)
    assert calls == [0, 1, 2, 4]
    fresh = profile_pipeline(cfg)
    assert [s.peak_bytes for s in reused.stages] == [s.peak_bytes for s in fresh.stages]
    assert pipe_point(reused) == pipe_point(fresh)


def test_pipeline_screen_is_exact_in_flops_and_a_lower_bound_in_peak():
    """pp=2 over fsdp=2, a 10-block Llama (5 a stage): the screen (3 and 4 blocks a stage,
    extrapolated) has the full pipeline's FLOPs per stage, and a peak no higher than its."""
    cfg = llama("pp=2,fsdp=2", kwargs={"n_layers": 10}, pp_split=STAGE, microbatches=2)

    def trace(c, loader):
        return pipe_point(profile_pipeline(c, loader))

    got = screen_pipeline(cfg, 10, 2, trace)
    full = pipe_point(profile_pipeline(cfg))
    assert got.model_flops == full.model_flops
    assert got.peak_bytes <= full.peak_bytes
    assert got.bubble_fraction == full.bubble_fraction
    # what a rank needs of the GPU: the screen's is its peak plus the fixed costs (400 MiB of CUDA
    # context, NCCL's buffers for the pp and fsdp groups), below the full replay through the allocator
    assert got.fixed_bytes == full.fixed_bytes == (400 + 2 * 8) * 2**20
    assert got.fit_bytes == got.peak_bytes + got.fixed_bytes <= full.fit_bytes


def test_pruned_layouts_are_counted_and_truly_over(monkeypatch):
    """A GPU of 60,000 B: the small Llama's 558,336 B of fp32 parameters (139,584 of them, counted
    in tests/test_parallel_plan.py) are 69,792 B on each of 8 GPUs, over it: every one of the 28
    layouts of 8 GPUs at global batch 16 is pruned before any trace (tp=4 and tp=8 by the heads)."""
    monkeypatch.setitem(devices.DEVICES, "h100", replace(devices.DEVICES["h100"], capacity_reported=60_000))
    result = plan(llama("fsdp=8"), 8, 16)
    assert (result.layouts, result.pruned, result.traced, result.reused, result.traces) == (28, 28, 0, 0, 0)
    assert -(-558_336 // 8) > 60_000


def test_plan_prints_and_carries_its_counts():
    """The header says how many layouts were traced, reused, pruned and settled by their group,
    JSON carries the same, they add up to the layouts enumerated, and stderr has one progress
    line per probe."""
    args = ["plan", LLAMA, "--gpus", "4", "--gpu", "h100", "--global-batch", "4", "--parallelize", PARALLELIZE,
            "--no-cache", "--jobs", "1", "--format", "json"]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    total, traced, reused, pruned = (doc[k] for k in ("layouts_total", "layouts_traced", "layouts_reused",
                                                      "layouts_pruned"))
    # 4 GPUs: fsdp=4 (1 example a rank: mb 1), fsdp=2,tp=2 (mb 1, 2), tp=4 (mb 1, 2, 4: tp=4 does not
    # divide n_kv_heads=2, pruned), checkpointing off and on: (1 + 2 + 3) × 2 = 12 layouts, 6 pruned
    assert (total, pruned) == (12, 6)
    assert traced > 0 and traced + reused + pruned <= total
    progress = [line for line in r.stderr.splitlines() if line.startswith("plan: ")]
    assert len(progress) >= traced + reused
    r = CliRunner().invoke(cli, args[:-2], catch_exceptions=False)
    head = r.stdout.splitlines()[0]
    settled = total - traced - reused - pruned
    assert head.endswith(f"12 layouts: {traced} traced, {reused} reused, 6 pruned, {settled} settled by their group")


def test_a_trace_is_named_the_same_in_another_process(tmp_path):
    """The disk cache serves reruns, other processes: a trace's file name (a hash of its Config,
    the files it names, fxacct's source and torch's version) holds no address or other value of
    one process."""
    import subprocess
    import sys

    from fxacct.tools.plan_cache import TraceCache

    code = ("import fxacct; from fxacct.tools.plan_cache import TraceCache; "
            f"c = fxacct.Config(target={LLAMA!r}, gpu='h100', mesh='fsdp=4', parallelize={PARALLELIZE!r}, "
            "kwargs={'n_layers': 2}, find_max_batch=False, loss='cross-entropy'); "
            f"print(TraceCache({str(tmp_path)!r})._path(c, ('point', 3)).name)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1]
    here = TraceCache(tmp_path)._path(replace(llama(kwargs={"n_layers": 2}), batch=1), ("point", 3)).name
    assert other == here
    assert TraceCache(tmp_path)._path(llama(kwargs={"n_layers": 3}), ("point", 3)).name != here


@pytest.mark.slow  # spawns two worker processes
def test_a_pooled_search_gives_the_plan_of_one_process():
    """--jobs 2 (a spawned worker per mesh) and --jobs 1 (this process) judge every layout alike:
    the same candidates in the same order, the same counts."""
    cfg = llama(kwargs={"n_layers": 2})
    one, two = plan(cfg, 4, 8, jobs=1), plan(cfg, 4, 8, jobs=2)
    assert two.candidates == one.candidates
    assert (two.layouts, two.traced, two.reused, two.pruned) == (one.layouts, one.traced, one.reused, one.pruned)


@pytest.mark.slow  # spawns two worker processes
def test_an_interrupted_pooled_search_frees_its_pool_before_it_returns():
    """Ctrl-C while the workers run: by the time the interrupt leaves plan(), the pool's manager
    thread is joined and its queues' semaphores are freed. The CLI leaves by os._exit, so anything
    freed later never is, and multiprocessing's tracker printed "5 leaked semaphore objects" after
    "error: interrupted" (one CI run in many: the thread was left to finish on its own)."""
    import concurrent.futures.process
    import gc
    import multiprocessing
    import multiprocessing.synchronize
    import os
    import signal
    import threading
    import time

    def semaphores() -> int:
        return sum(isinstance(o, multiprocessing.synchronize.SemLock) for o in gc.get_objects())

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while not multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the workers are importing torch: plan() is waiting on them
        os.kill(os.getpid(), signal.SIGINT)

    before = semaphores()
    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        plan(llama(kwargs={"n_layers": 2}), 4, 8, jobs=2)
    managers = [t for t in threading.enumerate() if isinstance(t, concurrent.futures.process._ExecutorManagerThread)]
    assert managers == [] and multiprocessing.active_children() == []
    assert semaphores() == before


@pytest.mark.slow  # a 70B-shaped plan's workers, interrupted once they run
def test_ctrl_c_stops_the_plan_and_its_workers_quietly(tmp_path):
    """Ctrl-C reaches the plan's whole process group: exit 130 with one "interrupted" line, no
    worker's KeyboardInterrupt traceback and no leaked-semaphore warning (both were printed), and no
    worker left running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT

    example = str(ROOT / "examples" / "llama.py")
    args = [sys.executable, "-m", "fxacct", "plan", f"{example}:Llama", "-k", "dim=8192", "-k", "n_layers=80",
            "-k", "n_heads=64", "-k", "n_kv_heads=8", "-k", "hidden=28672", "-k", "max_seq=4096",
            "--parallelize", f"{example}:parallelize", "--gpus", "64", "--gpu", "h100", "--global-batch", "512",
            "--no-cache", "--jobs", "2"]
    err = tmp_path / "stderr"
    with open(err, "w") as stream:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stream, start_new_session=True)
        deadline = time.monotonic() + 240
        while "plan: " not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # a progress line: the workers are tracing
        assert proc.poll() is None, err.read_text()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    text = err.read_text()
    assert code == 130 and text.rstrip().endswith("error: interrupted"), text
    assert "Traceback" not in text and "leaked" not in text, text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the group empties: every worker (and multiprocessing's tracker) gone
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    raise AssertionError("a process of the plan's group is still running 20 s after it exited")


def test_traces_that_raise_are_counted_beside_the_layouts_they_rejected():
    """The Llama without its --parallelize has no tensor-parallel plan: each tp layout's trace
    raises (the layout is rejected, saying why). The header said "0 traces" beside "2 traced";
    it now counts the traces that raised too, and JSON carries them apart."""
    from fxacct.report.plan_text import plan_json, render_plan

    cfg = fxacct.Config(target=LLAMA, gpu="h100", kwargs={"n_layers": 2}, find_max_batch=False)
    result = plan(cfg, 4, 6)
    raised = [c for c in result.candidates if c.rejected and "carries no tensor-parallel plan" in c.rejected]
    assert raised and {c.mesh for c in raised} == {"fsdp=2,tp=2"}
    assert (result.traces, result.failed, result.traced) == (0, 2, 2)  # micro-batches 1 and 2: a trace each
    head = render_plan(result, 4, 6, "h100").splitlines()[0]
    assert f"; {result.traces + result.failed} traces ({result.failed} raised); " in head
    assert plan_json(result)["traces_failed"] == result.failed
