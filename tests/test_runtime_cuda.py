"""Runtime mode on CUDA (skipped where there is no CUDA device).

What is checked: the run executes on the GPU with CUDA events and torch.cuda.max_memory_allocated;
the op-level peak (storage tracker, CUDA tensors) equals fxacct's peak_train_bytes for the local
GPU's kernel rules; the allocator-level peak is at least the op-level one (the caching allocator
rounds to 512-byte blocks and holds cuBLAS workspaces); the host-to-device transfer of a batch is
timed from pageable and pinned memory; MFU is against the table's datasheet peak of a known GPU."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import ROOT

from fxacct.errors import ModelError
from fxacct.load.config import Config
from fxacct.predict import calibration
from fxacct.predict.roofline import gpu_key
from fxacct.runtime import RuntimeOptions, run
from fxacct.runtime.setup import check_fits, free_bytes, resolve_device
from fxacct.tools import calibrate
from fxacct_cli.main import cli

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MLP = [str(ROOT / "examples/mlp.py") + ":MLP", "-k", "d_model=128", "-k", "d_hidden=256", "-k", "n_blocks=2",
       "--batch", "4"]
GPT = [str(ROOT / "examples/gpt2.py") + ":GPT", "-k", "n_layer=2", "-k", "n_embd=64", "-k", "n_head=4",
       "-k", "block_size=32", "-k", "vocab_size=100", "--batch", "2"]
FAST = ["--runtime", "--device", "cuda", "--steps", "3", "--warmup", "1"]


def runtime_doc(tmp_path, *args) -> dict:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(cli, ["profile", *args, "--format", "json", "-o", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(out.read_text())


def test_mlp_on_cuda(tmp_path):
    doc = runtime_doc(tmp_path, *MLP, *FAST)
    r = doc["runtime"]
    assert r["device"].startswith("cuda:") and r["steps"] == 3 and r["step_ms"] > 0
    assert r["peak_source"] == "torch.cuda.max_memory_allocated"
    predicted = doc["totals"]["peak_train_bytes"]
    assert r["op_level_peak_bytes"] == predicted
    assert r["peak_bytes"] >= r["op_level_peak_bytes"]
    t = r["transfer"]
    assert t["bytes"] == 4 * 128 * 4 and t["pageable_ms"] > 0 and t["pinned_ms"] > 0
    assert doc["config"]["gpu"] == gpu_key(torch.cuda.get_device_name())  # the local GPU's rules
    if doc["config"]["gpu"] is not None:  # a GPU of the table: datasheet prediction and MFU
        assert r["predicted_step_ms"] > 0 and 0 < r["mfu"] < 1
    modules = {m["module"]: m for m in r["modules"]}
    assert 0 < modules[""]["measured_ms"] <= r["profiled_step_ms"]
    assert r["join"]["matched_nodes"] == r["join"]["forward_nodes"]


def test_gpt2_bf16_amp_and_inference_on_cuda(tmp_path):
    doc = runtime_doc(tmp_path, *GPT, *FAST, "--amp", "bf16")
    r = doc["runtime"]
    assert r["step_ms"] > 0 and r["backward_ms"] > 0
    assert r["op_level_peak_bytes"] == doc["totals"]["peak_train_bytes"]
    doc = runtime_doc(tmp_path, *GPT, *FAST, "--inference")
    r = doc["runtime"]
    assert r["inference"] and r["backward_ms"] == 0
    assert r["op_level_peak_bytes"] == doc["totals"]["peak_inference_bytes"]


def test_calibrate_cuda_stores_the_local_gpu(tmp_path):
    cal = calibrate.calibrate("cuda", budget_s=0.1)
    path = calibration.save(cal)
    assert path.name.startswith("device-cuda-") and cal.kind == "cuda"
    assert cal.matmul_flops_per_s["bfloat16"] > cal.matmul_flops_per_s["float32"]
    assert calibration.load("cuda") == cal


def test_the_safety_check_uses_free_device_memory():
    device = resolve_device("cuda")
    free = free_bytes(device)
    assert 0 < free <= torch.cuda.get_device_properties(device).total_memory
    check_fits(free // 2, device, force=False)
    with pytest.raises(ModelError, match="--force"):
        check_fits(free * 2, device, force=False)
    check_fits(free * 2, device, force=True)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_reserved_of_a_run_is_the_replayed_runs(conf):
    """torch.cuda.max_memory_reserved of a run (its first steps included: the run makes the optimizer
    state at its first step, the cuBLAS workspaces at the first matmul of each thread) beside the
    replay's peak_reserved_bytes, under the --alloc-conf the run is given. On an H200 (torch 2.11) the
    replay was within 0.3% on GPT-2 124M and an 8-layer Llama, with and without expandable segments
    (docs/allocator.md); this tiny GPT is held to 5% (its 2 MiB small-pool segments are a coarse unit),
    and under expandable segments to one page of each pool."""
    gpu = gpu_key(torch.cuda.get_device_name())
    if gpu is None:
        pytest.skip(f"{torch.cuda.get_device_name()} is not in fxacct's GPU table: nothing replayed")
    torch.cuda.empty_cache()
    config = Config(target=GPT[0], batch=2, gpu=gpu, alloc_conf=conf, find_max_batch=False,
                    kwargs=dict(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=100))
    try:
        r = run(config, RuntimeOptions(device="cuda", steps=3, warmup=1))
    finally:  # torch's default for the tests after this one
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    predicted = r.profile.memory.reserved.peak_reserved_bytes
    assert r.profile.memory.reserved.expandable_segments == (conf != "")
    # expandable segments map pages: 20 MiB in the large pool in torch 2.13's source; torch 2.11 on an
    # H200 mapped this model's 64 MiB of workspaces in 64 (the replay: 80), so one page either way
    tolerance = 22 * 2**20 if conf else 0.05 * predicted
    assert abs(r.measured.reserved_bytes - predicted) <= tolerance, (r.measured.reserved_bytes, predicted)
