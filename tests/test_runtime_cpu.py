"""Runtime mode on the CPU: the real model under torch.profiler, measured beside predicted.

Small configs (the CI machine has 2 cores): the MLP at d_model 128, batch 4; GPT-2 at 2 layers,
n_embd 64, T 32, vocab 100. Timing figures are only checked for sign and consistency (a shared
machine's timings are noisy); memory is checked against the prediction: the op-level peak equals
``peak_train_bytes`` (the same definition, fxacct.runtime.storage_tracker) and the allocator-level peak is
within ±10% of it."""

from __future__ import annotations

import gc
import importlib
import json

import pytest
import torch
from click.testing import CliRunner
from helpers import ROOT

import fxacct
from fxacct.predict import calibration
from fxacct.runtime import RuntimeOptions, run
from fxacct_cli.main import cli

MLP = [str(ROOT / "examples/mlp.py") + ":MLP", "-k", "d_model=128", "-k", "d_hidden=256", "-k", "n_blocks=2",
       "--batch", "4"]
GPT = [str(ROOT / "examples/gpt2.py") + ":GPT", "-k", "n_layer=2", "-k", "n_embd=64", "-k", "n_head=4",
       "-k", "block_size=32", "-k", "vocab_size=100", "--batch", "2"]
FAST = ["--runtime", "--device", "cpu", "--steps", "3", "--warmup", "1"]
# DESIGN.md's JSON contract: the runtime keys
RUNTIME_KEYS = {"device", "steps", "step_ms", "forward_ms", "backward_ms", "optimizer_ms", "peak_bytes",
                "predicted_step_ms", "achieved_flops_per_s", "mfu"}


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def runtime_doc(tmp_path, *args) -> dict:
    out = tmp_path / "out.json"
    result = invoke("profile", *args, "--format", "json", "-o", str(out))
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(out.read_text())


def check_measured(doc: dict, inference: bool = False) -> dict:
    r = doc["runtime"]
    assert RUNTIME_KEYS <= set(r), RUNTIME_KEYS - set(r)
    assert r["device"] == "cpu" and r["steps"] == 3 and not r["interrupted"]
    assert r["step_ms"] > 0 and r["forward_ms"] > 0
    predicted = doc["totals"]["peak_inference_bytes" if inference else "peak_train_bytes"]
    assert r["predicted_peak_bytes"] == predicted
    # op level: the storage tracker measures what peak_*_bytes is defined as
    assert r["op_level_peak_bytes"] == predicted, (r["op_level_peak_bytes"], predicted)
    # allocator level: the profiler's memory events; kernel scratch may add a little
    assert r["peak_ratio"] == pytest.approx(r["peak_bytes"] / predicted)
    assert 0.9 <= r["peak_ratio"] <= 1.1, r["peak_ratio"]
    # module times nest: a module's children add up to at most the module, the root to at most the
    # step they were measured in (the median profiled step). Module times are the profiler's event
    # durations, the step perf_counter's, and each event carries a little of the profiler's own
    # bookkeeping: 2% covers that on a busy machine, while a module counted twice would be off by 100%.
    modules = {m["module"]: m for m in r["modules"]}
    root = modules[""]["measured_ms"]
    assert 0 < root <= r["profiled_step_ms"] * 1.02
    children = [m["measured_ms"] for name, m in modules.items() if name and "." not in name]
    assert sum(children) <= root * 1.02
    assert r["join"]["matched_nodes"] == r["join"]["forward_nodes"]  # every forward op found
    assert r["transfer"] is None  # CPU: nothing to transfer
    return r


def test_mlp_training_step(tmp_path):
    doc = runtime_doc(tmp_path, *MLP, *FAST)
    r = check_measured(doc)
    assert r["backward_ms"] > 0 and r["optimizer_ms"] > 0
    # not calibrated here: no predicted time and no MFU, never a made-up number
    assert r["predicted_step_ms"] is None and r["mfu"] is None and doc["totals"]["predicted_step_ms"] is None
    # achieved FLOP/s = model FLOPs (matmul + attention) / measured step time
    t = doc["totals"]
    model_flops = sum(t["forward_flops_by_class"][k] + t["backward_flops_by_class"][k] for k in ("matmul", "attention"))
    assert r["achieved_flops_per_s"] == pytest.approx(model_flops / (r["step_ms"] / 1e3))


def test_gpt2_training_step_with_a_calibrated_cpu_and_a_trace(tmp_path):
    calibration.save(calibration.Calibration(
        kind="cpu", name="test cpu", threads=1, torch_version="x", matmul_flops_per_s={"float32": 1e11},
        matmul_by_min_dim={}, bandwidth_bytes_per_s=1e10, bandwidth_by_bytes={"1000000": 1e10},
        measured_at="2026-01-01T00:00:00+00:00", sizes={}, seconds=0.0))
    trace = tmp_path / "trace.json"
    doc = runtime_doc(tmp_path, *GPT, *FAST, "--trace", str(trace))
    r = check_measured(doc)
    assert r["predicted_step_ms"] == pytest.approx(doc["totals"]["predicted_step_ms"]) and r["predicted_step_ms"] > 0
    assert r["step_ratio"] == pytest.approx(r["step_ms"] / r["predicted_step_ms"])
    # MFU against the calibrated fp32 matmul rate, 1e11 FLOP/s
    assert r["mfu"] == pytest.approx(r["achieved_flops_per_s"] / 1e11)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"fxacct.step", "fxacct.forward", "fxacct.backward", "fxacct.optimizer"} <= names  # measured
    predicted = [e for e in events if str(e.get("pid", "")).startswith("fxacct predicted") and e["ph"] == "X"]
    assert {"forward", "loss", "backward", "optimizer"} <= {e["name"] for e in predicted}
    assert any(e["name"] == "mm" for e in predicted)


def test_inference_compares_with_the_inference_peak(tmp_path):
    doc = runtime_doc(tmp_path, *MLP, *FAST, "--inference")
    r = check_measured(doc, inference=True)
    assert r["inference"] and r["backward_ms"] == 0 and r["optimizer_ms"] == 0


def test_text_report_shows_both_sides(tmp_path):
    result = invoke("profile", *MLP, *FAST)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "runtime on cpu" in out and "measured/predicted" in out and "peak memory (allocator)" in out
    assert "not calibrated" in out


def test_the_summary_of_a_runtime_run_shows_what_it_measured():
    """--summary after --runtime: the whole step as measured (step times, the measured/predicted
    table, the peaks, MFU); the measured modules and nodes are the full report's. It printed the
    account's summary alone, the run measured for nothing."""
    result = invoke("profile", *MLP, *FAST, "--summary")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "runtime on cpu" in out and "step times: fastest" in out and "measured/predicted" in out
    assert "peak memory (allocator)" in out and "MFU" in out
    assert "top 10 nodes by measured time" not in out and "modules (depth" not in out


@pytest.mark.parametrize("fmt", ["csv", "markdown"])
def test_runtime_with_a_report_that_cannot_show_it_is_refused_before_the_run(fmt, monkeypatch):
    """csv and markdown carry no runtime figures: refused before any real step runs (the run was
    made, then left out of the report)."""
    import fxacct.runtime

    monkeypatch.setattr(fxacct.runtime, "run", lambda *a, **k: pytest.fail("the real steps ran"))
    result = invoke("profile", *MLP, *FAST, "--format", fmt)
    assert result.exit_code == 2, result.output
    assert f"--format {fmt} carries no runtime figures" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize("fmt", ["csv", "markdown"])
def test_render_refuses_a_runtime_its_format_would_drop(fmt):
    from fxacct.report import render

    config = fxacct.Config(target=MLP[0], batch=4, kwargs=dict(d_model=128, d_hidden=256, n_blocks=2))
    r = run(config, RuntimeOptions(device="cpu", steps=1, warmup=0))
    with pytest.raises(fxacct.UsageError, match=f"the {fmt} report carries no runtime figures"):
        render(r.profile, fmt, runtime=r)
    assert "runtime on cpu" in render(r.profile, "text", runtime=r)


@pytest.mark.parametrize("stage, steps", [("timed", 2), ("profiled", 5)])
def test_ctrl_c_stops_and_keeps_what_was_measured(stage, steps):
    # a KeyboardInterrupt right after the second plain ("timed") or profiled step (raised from the
    # progress callback): the plain steps done are kept, and the join of the profiled steps done
    def progress(phase, done, total):
        if phase == stage and done == 2:
            raise KeyboardInterrupt

    config = fxacct.Config(target=MLP[0], batch=4, kwargs=dict(d_model=128, d_hidden=256, n_blocks=2))
    r = run(config, RuntimeOptions(device="cpu", steps=5, warmup=1), progress)
    m = r.measured
    assert m.interrupted and m.steps == steps and m.steps_requested == 5 and m.step_s > 0
    assert m.op_level_peak_bytes is None  # not measured after the interrupt
    if stage == "timed":
        assert m.join is None  # no profiled step ran
    else:
        assert m.join is not None and m.join.matched == m.join.expected


def test_ctrl_c_in_the_cli_writes_the_report_and_exits_130(tmp_path, monkeypatch):
    from fxacct.runtime.run import _Step

    original, timed = _Step.__call__, []

    def step(self, clock=None):
        if clock is not None:
            timed.append(1)
            if len(timed) == 2:  # Ctrl-C in the middle of the second timed step
                raise KeyboardInterrupt
        return original(self, clock)

    monkeypatch.setattr(_Step, "__call__", step)
    out = tmp_path / "out.json"
    result = invoke("profile", *MLP, *FAST, "--format", "json", "-o", str(out))
    assert result.exit_code == 130, result.output
    assert "interrupted after 1 of 3 timed steps" in result.stderr
    r = json.loads(out.read_text())["runtime"]
    assert r["interrupted"] and r["steps"] == 1 and r["step_ms"] > 0


@pytest.mark.parametrize("args, code, words", [
    (["--steps", "0"], 2, "--steps must be at least 1"),
    (["--warmup", "-1"], 2, "--warmup"),
    (["--device", "tpu"], 2, "--device"),
    (["--gpu", "h100"], 2, "--gpu h100 is a CUDA target"),
])
def test_bad_runtime_flags_are_usage_errors(args, code, words):
    result = invoke("profile", *MLP, "--runtime", "--device", "cpu", *args)
    assert result.exit_code == code, result.output
    assert words in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_cuda_without_cuda_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = invoke("profile", *MLP, "--runtime", "--device", "cuda")
    assert result.exit_code == 2
    assert "no CUDA device" in result.stderr and result.stderr.count("\n") == 1


def test_a_model_too_big_for_free_memory_is_refused():
    # 1 block, d_model 50,000, d_hidden 200,000: 2·50,000·200,000 = 2e10 parameters, 80 GB in fp32
    # before gradients and AdamW state: no machine running these tests has that free
    big = [str(ROOT / "examples/mlp.py") + ":MLP", "-k", "d_model=50000", "-k", "d_hidden=200000",
           "-k", "n_blocks=1", "--batch", "1"]
    result = invoke("profile", *big, "--runtime", "--device", "cpu")
    assert result.exit_code == 3, result.output
    assert "exceeds the free memory" in result.stderr and "--force" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.slow  # a whole process; test_gpt2_training_step_with_a_calibrated_cpu_and_a_trace stays fast
def test_a_runtime_run_writes_only_fxacct_lines_to_stderr(tmp_path):
    # acceptance (issue 10, item 5): a real process, as a user runs it; kineto's "USDT: ...
    # profiler_start" lines are silenced at their source (fxacct.trace.torch_private.quiet_kineto)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    cmd = [sys.executable, "-m", "fxacct_cli", "profile", str(ROOT / "examples/two_layer.py") + ":TwoLayer",
           "--runtime", "--device", "cpu", "--steps", "2", "--warmup", "1"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    # not a terminal: one line per phase, each saying what it counts
    assert lines == ["fxacct runtime: warm-up 1 step", "fxacct runtime: timed 2 steps",
                     "fxacct runtime: profiled 2 steps", "fxacct runtime: op-level peak 1 step"], done.stderr
    assert "runtime on cpu" in done.stdout


def test_progress_draws_a_bar_on_a_terminal_and_lines_otherwise():
    import io

    from fxacct.runtime.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    log, tty = io.StringIO(), Tty()
    for stream in (log, tty):
        with Progress(stream) as p:
            for phase, total in (("warm-up", 3), ("timed", 10)):
                for done in range(total + 1):
                    p(phase, done, total)
    assert log.getvalue() == "fxacct runtime: warm-up 3 steps\nfxacct runtime: timed 10 steps\n"
    frames = tty.getvalue().split("\r")[1:]
    assert len(frames) == 4 + 11 and tty.getvalue().endswith("\n")  # one redraw per call, the line ended
    assert "[" + "#" * 24 + "] 10/10 steps" in frames[-1] and "[" + "-" * 24 + "] 0/3 steps" in frames[0]


def test_kernel_scratch_is_called_out_when_the_allocator_peak_is_far_above_the_prediction():
    """5,000 B at the allocator against 1,000 predicted and 1,000 at the op level: 4,000 B (3.91 KiB)
    are kernel scratch; at 1.25x or below, nothing is said."""
    from fxacct.report.runtime_text import _scratch_note

    (line,) = _scratch_note(1000, 5000, 1000)
    assert "5.00x the predicted" in line and "op-level peak is 1.00x" in line and "3.91 KiB" in line
    assert _scratch_note(1000, 1250, 1000) == []
    assert _scratch_note(None, 5000, 1000) == []


def test_a_one_command_process_measures_the_real_steps_with_the_collector_on(one_command_process, monkeypatch):
    # the CLI switches its collector off (fxacct.heap.one_command_process); a training loop runs with it
    # on, and so do the steps measured: warm-up, timed and profiled. The op-level peak's step pauses it
    # on purpose (storages in reference cycles die at a fixed point), and the process's stays off after
    runtime_run = importlib.import_module("fxacct.runtime.run")  # the module (fxacct.runtime.run is its function)
    seen = []
    step = runtime_run._Step.__call__
    monkeypatch.setattr(runtime_run._Step, "__call__", lambda self, *a: (seen.append(gc.isenabled()), step(self, *a))[1])
    config = fxacct.Config(target=MLP[0], kwargs={"d_model": 64, "d_hidden": 128, "n_blocks": 1}, batch=2)
    runtime_run.measure(config, torch.device("cpu"), steps=2, warmup=1)
    assert seen == [True] * 5 + [False], seen
    assert not gc.isenabled()
