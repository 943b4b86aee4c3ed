"""`fxacct calibrate` and the device profile predictions use (fxacct.predict.calibrate)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fxacct
from fxacct.predict import calibrate
from fxacct.predict.roofline import for_config, for_local, from_calibration, predict_profile
from fxacct_cli.main import cli
from helpers import ROOT

TWO_LAYER = str(ROOT / "examples/two_layer.py") + ":TwoLayer"


@pytest.fixture
def cache(cache_dir):
    """This test's own cache dir (tests/conftest.py points $FXACCT_CACHE_DIR at it)."""
    return cache_dir


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def fake_calibration(**over) -> calibrate.Calibration:
    values = dict(kind="cpu", name="test cpu", threads=1, torch_version=torch.__version__,
                  matmul_flops_per_s={"float32": 1e6}, matmul_by_min_dim={}, bandwidth_bytes_per_s=1e9,
                  bandwidth_by_bytes={"1000": 1e9}, measured_at="2026-01-01T00:00:00+00:00", sizes={},
                  seconds=0.0)
    values.update(over)
    return calibrate.Calibration(**values)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path, cache):
    # order: $FXACCT_CACHE_DIR, else $XDG_CACHE_HOME/fxacct, else ~/.cache/fxacct
    assert calibrate.cache_dir() == cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibrate.cache_dir() == cache  # FXACCT_CACHE_DIR wins over both
    monkeypatch.delenv("FXACCT_CACHE_DIR")
    assert calibrate.cache_dir() == tmp_path / "xdg" / "fxacct"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty is unset (XDG Base Directory spec)
    assert calibrate.cache_dir() == tmp_path / "home" / ".cache" / "fxacct"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert calibrate.cache_dir() == tmp_path / "home" / ".cache" / "fxacct"
    assert calibrate.profile_path("cpu") == tmp_path / "home" / ".cache" / "fxacct" / "device-cpu.json"


def test_conftest_isolates_every_test_from_the_user_cache(cache):
    # tests/conftest.py: no test may see ~/.cache/fxacct (a calibration there changed predictions)
    real = Path.home() / ".cache" / "fxacct"
    assert calibrate.cache_dir() == cache != real
    assert not cache.exists() and calibrate.load("cpu") is None


def test_calibrate_cpu_measures_and_stores_a_profile(cache):
    # consistency only: no rate is compared with a speed, so a slow or busy machine passes too
    result = invoke("calibrate", "--device", "cpu")
    assert result.exit_code == 0, result.output
    data = json.loads((cache / "device-cpu.json").read_text())
    assert data["schema"] == "fxacct.device/1" and data["kind"] == "cpu"
    assert data["threads"] == torch.get_num_threads()
    assert set(data["matmul_flops_per_s"]) == set(data["sizes"]) == set(data["matmul_by_min_dim"]) == {
        "float32", "bfloat16", "float16"}
    for key, rate in data["matmul_flops_per_s"].items():
        n = data["sizes"][key]
        assert rate > 0 and n in (512, 1024, 2048)  # 512 doubled up to the CPU cap
        # the skinny products, then the square itself: four distinct classes on any machine
        assert sorted(map(int, data["matmul_by_min_dim"][key])) == [16, 64, 256, n]
        assert data["matmul_by_min_dim"][key][str(n)] == rate
        assert all(r > 0 for r in data["matmul_by_min_dim"][key].values())
    # one footprint per buffer size: 2 × (1, 4, 16, 64, 256) MiB, the copy's read + write
    assert list(map(int, data["bandwidth_by_bytes"])) == [2 * 2**20 * m for m in (1, 4, 16, 64, 256)]
    assert all(bw > 0 for bw in data["bandwidth_by_bytes"].values())
    assert data["bandwidth_bytes_per_s"] == data["bandwidth_by_bytes"][str(2 * 256 * 2**20)]
    assert data["seconds"] > 0
    assert "stored" in result.stdout and "TFLOP/s" in result.stdout and "GB/s" in result.stdout
    # predictions for this CPU now use it
    model = for_config(fxacct.Config(target=TWO_LAYER))
    assert model is not None and model.source.startswith("calibrated")
    doc = json.loads(invoke("profile", TWO_LAYER, "--format", "json").stdout)
    assert doc["totals"]["predicted_step_ms"] > 0


@pytest.mark.parametrize("seconds, n", [
    (1.0, 512),  # a very slow machine: the first square already takes MIN_OP_S
    (1e-9, 2048),  # a very fast one: every square is too short, n stops at the CPU cap
])
def test_matmul_classes_never_collide_whatever_the_speed(monkeypatch, seconds, n):
    # every repetition "takes" `seconds`: rate = FLOPs / seconds, by hand per product
    monkeypatch.setattr(calibrate, "_repeat", lambda timer, fn, budget: seconds)
    monkeypatch.setattr(calibrate, "measure_bandwidth", lambda kind, budget_s: {2000: 1e9})
    cal = calibrate.calibrate("cpu")
    for key in ("float32", "bfloat16", "float16"):
        assert cal.sizes[key] == n
        assert cal.matmul_flops_per_s[key] == 2 * n**3 / seconds
        # (d×n) @ (n×n): 2·d·n² FLOPs for d = 16, 64, 256, and the square (n×n) @ (n×n)
        assert cal.matmul_by_min_dim[key] == {str(d): 2 * d * n * n / seconds for d in (16, 64, 256, n)}
    with pytest.raises(ValueError, match="must exceed"):
        calibrate.measure_skinny("cpu", "float32", 256)  # a 256² square would be the 256 class


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


def _stored(**over) -> dict:
    return {"schema": "fxacct.device/1", **dataclasses.asdict(fake_calibration()), **over}


@pytest.mark.parametrize("content, says", [
    ("{not json", "Expecting property name"),
    (b"\xff\xfe binary", "codec can't decode"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps(_stored(schema="fxacct.device/0")), "unknown schema"),
    (json.dumps({k: v for k, v in _stored().items() if k != "threads"}), "threads"),
    (json.dumps(_stored(speed=1)), "speed"),
    (json.dumps(_stored(kind="tpu")), "kind is 'tpu'"),
    (json.dumps(_stored(matmul_flops_per_s=[1e6])), "matmul_flops_per_s is not a mapping"),
    (json.dumps(_stored(matmul_flops_per_s={"float32": "fast"})), "not a positive number"),
    (json.dumps(_stored(matmul_flops_per_s={"bfloat16": 1e6})), "no float32 rate"),
    (json.dumps(_stored(matmul_by_min_dim={"float32": {"sixteen": 1e6}})), "not a size"),
    (json.dumps(_stored(bandwidth_bytes_per_s=0)), "bandwidth_bytes_per_s is 0"),
    (json.dumps(_stored(bandwidth_by_bytes={"1000": -1})), "not a positive number"),
], ids=["not-json", "not-utf8", "a-list", "old-schema", "missing-field", "unknown-field", "kind",
        "rates-a-list", "rate-a-string", "no-float32", "dim-not-a-size", "zero-bandwidth", "negative-bandwidth"])
def test_a_bogus_profile_is_a_one_line_usage_error(cache, content, says):
    cache.mkdir(parents=True)
    path = cache / "device-cpu.json"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(fxacct.UsageError, match="fxacct calibrate") as e:
        calibrate.load("cpu")
    assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    result = invoke("profile", TWO_LAYER)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "fxacct calibrate" in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_an_unwritable_cache_dir_is_a_one_line_usage_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FXACCT_CACHE_DIR", str(blocker / "fxacct"))  # its parent is a file
    monkeypatch.setattr(calibrate, "calibrate", lambda device, progress=None: fake_calibration())
    result = invoke("calibrate", "--device", "cpu")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "FXACCT_CACHE_DIR" in result.stderr, result.stderr


def test_a_stored_profile_round_trips(cache):
    path = calibrate.save(fake_calibration())
    assert path == cache / "device-cpu.json"
    assert calibrate.load("cpu") == fake_calibration()
    assert [p.name for p in cache.iterdir()] == ["device-cpu.json"]  # no temporary file left


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
