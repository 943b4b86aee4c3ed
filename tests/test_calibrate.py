"""`fxacct calibrate` and the device profile predictions use (fxacct.predict.calibrate)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from click.testing import CliRunner

import fxacct
from fxacct.predict import calibrate
from fxacct.predict.roofline import for_config, for_local, from_calibration, predict_profile
from fxacct_cli.main import cli
from helpers import ROOT

TWO_LAYER = str(ROOT / "examples/two_layer.py") + ":TwoLayer"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("FXACCT_CACHE_DIR", str(path))
    return path


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def fake_calibration(**over) -> calibrate.Calibration:
    values = dict(kind="cpu", name="test cpu", threads=1, torch_version=torch.__version__,
                  matmul_flops_per_s={"float32": 1e6}, matmul_by_min_dim={}, bandwidth_bytes_per_s=1e9,
                  bandwidth_by_bytes={"1000": 1e9}, measured_at="2026-01-01T00:00:00+00:00", sizes={},
                  seconds=0.0)
    values.update(over)
    return calibrate.Calibration(**values)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    assert calibrate.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("FXACCT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibrate.cache_dir() == tmp_path / "xdg" / "fxacct"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibrate.cache_dir() == tmp_path / "home" / ".cache" / "fxacct"


def test_calibrate_cpu_measures_and_stores_a_profile(cache):
    t0 = time.perf_counter()
    result = invoke("calibrate", "--device", "cpu")
    seconds = time.perf_counter() - t0
    assert result.exit_code == 0, result.output
    assert seconds < 20, seconds  # the bound on 2 cores
    data = json.loads((cache / "device-cpu.json").read_text())
    assert data["schema"] == "fxacct.device/1" and data["kind"] == "cpu"
    assert data["threads"] == torch.get_num_threads()
    assert set(data["matmul_flops_per_s"]) == {"float32", "bfloat16", "float16"}
    # plausible ranges for any CPU of this decade: 0.1 GFLOP/s .. 100 TFLOP/s, 0.1 .. 10,000 GB/s
    for rate in data["matmul_flops_per_s"].values():
        assert 1e8 < rate < 1e14
    for key, by_dim in data["matmul_by_min_dim"].items():  # skinny products, then the square itself
        assert sorted(map(int, by_dim)) == [16, 64, 256, data["sizes"][key]]
        assert by_dim[str(data["sizes"][key])] == data["matmul_flops_per_s"][key]
    for bw in data["bandwidth_by_bytes"].values():
        assert 1e8 < bw < 1e13
    assert data["bandwidth_bytes_per_s"] == data["bandwidth_by_bytes"][max(data["bandwidth_by_bytes"], key=int)]
    assert "stored" in result.stdout and "TFLOP/s" in result.stdout and "GB/s" in result.stdout
    # predictions for this CPU now use it
    model = for_config(fxacct.Config(target=TWO_LAYER))
    assert model is not None and model.source.startswith("calibrated")
    doc = json.loads(invoke("profile", TWO_LAYER, "--format", "json").stdout)
    assert doc["totals"]["predicted_step_ms"] > 0


def test_a_stored_profile_drives_the_prediction_by_hand(cache):
    # matmul 1e6 FLOP/s: TwoLayer at B=2 runs 60 forward matmul FLOPs = 60 µs, 84 backward = 84 µs;
    # memory at 1e18 B/s adds nothing measurable (the CPU model adds it: test below)
    fast_memory = {"bandwidth_bytes_per_s": 1e18, "bandwidth_by_bytes": {"1000": 1e18}}
    calibrate.save(fake_calibration(**fast_memory))
    assert calibrate.load("cpu") == fake_calibration(**fast_memory)
    p = fxacct.profile(fxacct.Config(target=TWO_LAYER, batch=2))
    pr = predict_profile(p)
    assert pr.device.name == "test cpu"
    assert pr.by_phase["forward"] == pytest.approx(60e-6)
    assert pr.by_phase["backward"] == pytest.approx(84e-6)
    assert for_local("cpu") == from_calibration(fake_calibration(**fast_memory))
    assert for_local("cuda", None) is None  # no GPU calibrated, no table entry named


def test_calibrate_cuda_without_cuda_is_a_usage_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = invoke("calibrate", "--device", "cuda")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "--device cpu" in result.stderr


def test_an_unreadable_profile_is_a_one_line_usage_error(cache):
    cache.mkdir(parents=True)
    (cache / "device-cpu.json").write_text("{not json")
    result = invoke("profile", TWO_LAYER)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "fxacct calibrate" in result.stderr


def test_a_calibrated_cpu_adds_compute_and_memory_time():
    # one op: 1,000 matmul FLOPs at 1e6 FLOP/s = 1 ms, 2,000 B at 1e9 B/s = 2 µs; a CPU streams
    # and computes in turn (fxacct.predict.roofline: the ECM model's no-overlap bound), a GPU overlaps
    from fxacct.costs.registry import Flops
    from fxacct.predict.roofline import op_seconds

    cpu = from_calibration(fake_calibration())
    seconds, bound = op_seconds(Flops(matmul=1000), 2000, torch.float32, cpu)
    assert seconds == pytest.approx(1e-3 + 2e-6) and bound == "compute"
    gpu = from_calibration(fake_calibration(kind="cuda"))
    assert op_seconds(Flops(matmul=1000), 2000, torch.float32, gpu)[0] == pytest.approx(1e-3)
