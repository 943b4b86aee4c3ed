"""`fxacct calibrate` and the device profile predictions use (fxacct.tools.calibrate)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import ROOT

import fxacct
from fxacct.errors import UsageError
from fxacct.predict import calibration
from fxacct.predict.fused_time import predict_profile
from fxacct.predict.roofline import for_config, for_local, from_calibration
from fxacct.tools import calibrate
from fxacct.tools import calibrate_overhead as overhead
from fxacct_cli.main import cli

TWO_LAYER = str(ROOT / "examples/two_layer.py") + ":TwoLayer"


@pytest.fixture
def cache(cache_dir):
    """This test's own cache dir (tests/conftest.py points $FXACCT_CACHE_DIR at it)."""
    return cache_dir


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def fake_calibration(**over) -> calibration.Calibration:
    values = dict(kind="cpu", name="test cpu", threads=1, torch_version=torch.__version__,
                  matmul_flops_per_s={"float32": 1e6}, matmul_by_min_dim={}, bandwidth_bytes_per_s=1e9,
                  bandwidth_by_bytes={"1000": 1e9}, measured_at="2026-01-01T00:00:00+00:00", sizes={},
                  seconds=0.0)
    values.update(over)
    return calibration.Calibration(**values)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path, cache):
    # order: $FXACCT_CACHE_DIR, else $XDG_CACHE_HOME/fxacct, else ~/.cache/fxacct
    assert calibration.cache_dir() == cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibration.cache_dir() == cache  # FXACCT_CACHE_DIR wins over both
    monkeypatch.delenv("FXACCT_CACHE_DIR")
    assert calibration.cache_dir() == tmp_path / "xdg" / "fxacct"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty is unset (XDG Base Directory spec)
    assert calibration.cache_dir() == tmp_path / "home" / ".cache" / "fxacct"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert calibration.cache_dir() == tmp_path / "home" / ".cache" / "fxacct"
    assert calibration.profile_path("cpu") == tmp_path / "home" / ".cache" / "fxacct" / "device-cpu.json"


def test_conftest_isolates_every_test_from_the_user_cache(cache):
    # tests/conftest.py: no test may see ~/.cache/fxacct (a calibration there changed predictions)
    real = Path.home() / ".cache" / "fxacct"
    assert calibration.cache_dir() == cache != real
    assert not cache.exists() and calibration.load("cpu") is None


@pytest.mark.slow  # runs the CPU microbenchmarks
def test_calibrate_cpu_measures_and_stores_a_profile(cache):
    # consistency only: no rate is compared with a speed, so a slow machine passes too; a busy one
    # may be refused (exit 2, one line, nothing stored), but never stores what fails its checks
    result = invoke("calibrate", "--device", "cpu")
    if result.exit_code == 2:
        assert result.stderr.splitlines()[-1].startswith("error: calibration refused, nothing stored: ") and \
            not result.stdout and not (cache / "device-cpu.json").exists(), result.output
        pytest.skip(f"this machine is busy: {result.stderr.splitlines()[-1]}")
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
    from fxacct.tools import microbench

    monkeypatch.setattr(microbench, "best_of", lambda timer, fn, budget: seconds)
    monkeypatch.setattr(calibrate, "measure_bandwidth", lambda kind, budget_s, warnings: ({2000: 1e9}, 0.0))
    cal = calibrate.calibrate("cpu")
    assert cal.warnings == [] and set(cal.spread.values()) == {0.0}  # every round the same: stable
    # 3×3 convolutions C -> C, batch 8, side×side: 2·8·C²·9·side² FLOPs
    assert cal.convolution_by_channels == {"float32": {str(c): 2 * 8 * c * c * 9 * side * side / seconds
                                                       for c, side in microbench.CONV_SHAPES}}
    # the small training step "takes" `seconds` too (no phase splits: best_of never ran it), as does
    # the trivial op; whatever the roofline makes of the step, no op costs less than the trivial op,
    # and a view costs it exactly
    assert cal.dispatch_s_per_op == pytest.approx(seconds) and cal.view_s_per_op == pytest.approx(seconds)
    assert cal.dispatch_s_by_phase == {}
    # max-pool 2×2 of (8, 32, 32, 32) float32: reads 8·32·32·32·4 = 1,048,576 B, writes the values
    # 262,144 B and int64 indices 524,288 B: 1,835,008 B per call
    assert cal.kernel_bytes_per_s["aten.max_pool2d_with_indices.default"] == pytest.approx(1835008 / seconds)
    assert "aten.native_batch_norm_backward.default" in cal.kernel_bytes_per_s
    for key in ("float32", "bfloat16", "float16"):
        assert cal.sizes[key] == n
        assert cal.matmul_flops_per_s[key] == pytest.approx(2 * n**3 / seconds)
        # (d×n) @ (n×n): 2·d·n² FLOPs for d = 16, 64, 256, and the square (n×n) @ (n×n)
        assert cal.matmul_by_min_dim[key] == pytest.approx({str(d): 2 * d * n * n / seconds for d in (16, 64, 256, n)})
    with pytest.raises(ValueError, match="must exceed"):
        calibrate.measure_skinny("cpu", "float32", 256)  # a 256² square would be the 256 class


def test_a_stored_profile_drives_the_prediction_by_hand(cache):
    # matmul 1e6 FLOP/s: TwoLayer at B=2 runs 60 forward matmul FLOPs = 60 µs, 84 backward = 84 µs;
    # memory at 1e18 B/s adds nothing measurable (the CPU model adds it: test below)
    fast_memory = {"bandwidth_bytes_per_s": 1e18, "bandwidth_by_bytes": {"1000": 1e18}}
    calibration.save(fake_calibration(**fast_memory))
    assert calibration.load("cpu") == fake_calibration(**fast_memory)
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


@pytest.mark.parametrize("device", ["tpu", "", "mps"])
def test_calibrate_on_a_device_it_cannot_measure_is_a_usage_error(device):
    # a name torch does not know ("tpu", "") raised torch's own RuntimeError: an internal error, exit 4
    result = invoke("calibrate", "--device", device)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "not supported: use cpu or cuda" in result.stderr


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
        calibration.load("cpu")
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
    path = calibration.save(fake_calibration())
    assert path == cache / "device-cpu.json"
    assert calibration.load("cpu") == fake_calibration()
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


class ScriptedTimer:
    """A fake timer: each call "takes" the next of ``times`` seconds (no machine speed involved)."""

    def __init__(self, times):
        self.times, self.calls = list(times), 0

    def __call__(self, fn):
        self.calls += 1
        return self.times.pop(0)


def test_a_measurement_repeats_until_two_rounds_agree():
    from fxacct.tools import microbench

    budget = 6.0  # each round fills budget / 2 = 3 s, at least 3 repetitions (after one warm-up)
    # round 1: 3 × 1.0 s -> best 1.0; round 2: 3 × 2.0 -> 2.0 (100% apart: again); round 3: 1.02
    # (within 5% of 1.0: stable). Fastest 1.0; spread (2.0 - 1.0) / 1.0 = 1.0
    timer = ScriptedTimer([1.0] * 3 + [2.0] * 3 + [1.02] * 3)
    t = microbench.stable(timer, lambda: None, budget)
    assert (t.seconds, t.spread, t.rounds, t.stable) == (1.0, 1.0, 3, True) and timer.calls == 9
    # never agreeing (each round half the last): stops after MAX_ROUNDS and says so; the fastest is
    # kept, spread (first − last) / last = 2^(MAX_ROUNDS − 1) − 1
    rounds = [4.0 / 2**i for i in range(microbench.MAX_ROUNDS)]
    timer = ScriptedTimer([x for r in rounds for x in [r] * max(3, int(3 / r) + 1)] + [rounds[-1]] * 100)
    t = microbench.stable(timer, lambda: None, budget)
    assert (t.seconds, t.rounds, t.stable) == (rounds[-1], microbench.MAX_ROUNDS, False)
    assert t.spread == 2 ** (microbench.MAX_ROUNDS - 1) - 1


def test_two_rounds_under_ten_percent_apart_settle_a_figure_the_rest_do_not():
    from fxacct.tools import microbench

    budget = 6.0
    # rounds of 1.00, 1.08 and 1.00 s (3 repetitions each): rounds 1 and 2 are 8% apart, so a third
    # runs; it agrees with the first (0%), which stops the rounds there, stable
    timer = ScriptedTimer([x for r in (1.0, 1.08, 1.0) for x in [r] * 3])
    t = microbench.stable(timer, lambda: None, budget)
    assert (t.stable, t.rounds, t.apart) == (True, 3, 0.0) and timer.calls == 9
    # a fastest round of 1.00 and every other 1.08 s: the two fastest 8% apart, not stable (every
    # round was run) but settled; 1.12 s, 12% apart: not settled, which refuses a calibration
    for other, settled in ((1.08, True), (1.12, False)):
        timer = ScriptedTimer([1.0] * 3 + [other] * 3 * (microbench.MAX_ROUNDS - 1))
        t = microbench.stable(timer, lambda: None, budget)
        assert (t.stable, t.rounds, t.settled) == (False, microbench.MAX_ROUNDS, settled)
        assert t.apart == pytest.approx(other - 1.0)
        problems = []
        calibrate._unsettled("matmul float16", [t], problems)
        assert problems == ([] if settled else ["matmul float16: its rounds never agreed within 10% (12% apart)"])


def test_a_calibration_times_on_the_threads_the_steps_run_on():
    """torch.utils.benchmark.Timer runs its statement on one thread unless told: a calibration
    timed so measured half this 2-core machine's rates (14.7 against 28.6 GB/s streaming 512 MiB)
    and predicted multi-threaded steps twice too slow (the MLP example at 0.43)."""
    from fxacct.tools import microbench

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        microbench.Timer("cpu")(lambda: seen.append(torch.get_num_threads()))
        assert seen and set(seen) == {2}  # benchmark.Timer may call it more than once
    finally:
        torch.set_num_threads(threads)


def test_an_unsettled_measurement_refuses_the_calibration_and_keeps_the_stored_profile(monkeypatch, cache):
    # every round of every measurement "takes" 1 s (stable), but the bandwidth's rounds never agree:
    # its figure is not established, so nothing is stored and the earlier profile stays
    from fxacct.tools import microbench

    monkeypatch.setattr(microbench, "best_of", lambda timer, fn, budget: 1.0)

    def bandwidth(kind, nbytes, budget_s, timer=None):
        return 1e9, microbench.Timing(1.0, 0.5, microbench.MAX_ROUNDS, False)

    monkeypatch.setattr(microbench, "bandwidth", bandwidth)
    before = fake_calibration()
    calibration.save(before)
    result = invoke("calibrate", "--device", "cpu")
    last = result.stderr.splitlines()[-1]
    assert result.exit_code == 2 and not result.stdout, result.output
    assert last.startswith("error: calibration refused, nothing stored: memory bandwidth: its rounds "
                           "never agreed within 10% (50% apart); ") and last.endswith("idle machine"), last
    assert calibration.load("cpu") == before


def test_a_fixed_cost_fit_through_unsettled_points_refuses(monkeypatch):
    # the "0 s" latencies: a kernel whose two points never settled has no fixed cost to store
    from fxacct.tools import microbench

    monkeypatch.setattr(microbench, "best_of", lambda timer, fn, budget: 1.0)
    monkeypatch.setattr(calibrate, "measure_bandwidth", lambda kind, budget_s, problems: ({2000: 1e9}, 0.0))
    real = microbench.kernels

    def kernels(kind, budget_s, timer=None):
        rates, latency, spread, _ = real(kind, budget_s, timer)
        return rates, latency, spread, ["aten.native_batch_norm.default"]

    monkeypatch.setattr(microbench, "kernels", kernels)
    with pytest.raises(UsageError, match=r"kernel aten.native_batch_norm.default: its fixed cost per call could "
                                         r"not be fit"):
        calibrate.calibrate("cpu")


def test_kernels_lists_the_ops_whose_points_never_settled(monkeypatch):
    # the 1 MiB case of every kernel settles, the 64 KiB case of batch norm does not: no fit for it
    from fxacct.tools import microbench

    def stable(timer, fn, budget_s):
        small = fn.__defaults__[1][0].numel() < 8 * 32 * 32 * 32 if fn.__defaults__ else False
        batch_norm = fn.__defaults__[0] is torch.ops.aten.native_batch_norm.default
        return microbench.Timing(1e-3, 0.0, 2, not (small and batch_norm))

    monkeypatch.setattr(microbench, "stable", stable)
    rates, latency, _, unfit = microbench.kernels("cpu", 0.01)
    assert unfit == ["aten.native_batch_norm.default"] and latency["aten.native_batch_norm.default"] == 0.0
    assert set(rates) == set(latency) and len(rates) == 12


def test_a_convolution_with_more_channels_slower_than_fewer_refuses(monkeypatch):
    # 3×3 convolutions batch 8 scripted at 1 ms each whatever their size: FLOPs 2·8·C²·9·side²
    # over 1 ms grow with C, plausible; then the 128-channel class at 1 s: 2·8·128²·9·16² / 1 s =
    # 0.604 GFLOP/s, below 0.8 × the 32-channel class's 2·8·32²·9·32² / 1 ms = 151 GFLOP/s
    from fxacct.tools import microbench

    slow = {}

    def convolution(kind, channels, side, budget_s, timer=None, backward=False):
        seconds = slow.get(channels, 1e-3)
        flops = (2 if backward else 1) * 2 * 8 * channels * channels * 9 * side * side
        return flops / seconds, microbench.Timing(seconds, 0.0, 2, True)

    monkeypatch.setattr(microbench, "convolution", convolution)
    problems = []
    calibrate.measure_convolutions("cpu", 0.0, 0.3, problems)
    assert problems == []
    slow[128] = 1.0
    calibrate.measure_convolutions("cpu", 0.0, 0.3, problems)
    assert problems[0] == "convolution float32: 128 channels ran at 0.604 GFLOP/s, below 32 channels' 151"


def test_a_square_slower_than_a_skinny_product_is_remeasured_then_rejected(monkeypatch):
    # square rates scripted per call; skinny products at 100 GFLOP/s (d=256), 50, 10; the square is
    # implausible below 0.8 × 100 = 80 GFLOP/s
    from fxacct.tools import microbench

    squares = []

    def square(kind, key, n, budget_s, timer=None):
        return squares.pop(0), microbench.Timing(1.0, 0.0, 2, True)

    def skinny(kind, key, d, n, budget_s, timer=None):
        return {16: 10e9, 64: 50e9, 256: 100e9}[d], microbench.Timing(1.0, 0.0, 2, True)

    monkeypatch.setattr(microbench, "square", square)
    monkeypatch.setattr(microbench, "skinny", skinny)
    # a disturbed first square (2 GFLOP/s, the case), a plausible re-measurement: kept
    squares[:] = [2e9, 150e9]
    warnings = []
    rate, n, by_dim, _ = calibrate._matmul("cpu", "float32", 0.3, warnings)
    assert rate == 150e9 and by_dim == {"16": 10e9, "64": 50e9, "256": 100e9, str(n): 150e9} and not warnings
    # implausible twice: a problem (the calibration is refused)
    squares[:] = [2e9, 3e9]
    calibrate._matmul("cpu", "float32", 0.3, warnings)
    assert warnings == ["matmul float32: the 512² square measured 3 GFLOP/s twice, below the 256-row product's 100"]
    # a square within the noise of the skinny rate (0.9 × 100) is plausible: measured once
    squares[:] = [90e9]
    assert calibrate._matmul("cpu", "float32", 0.3, [])[0] == 90e9 and squares == []


def test_implausible_picks_the_fastest_skinny_product():
    assert calibrate.implausible(100.0, {16: 10.0, 64: 50.0}) is None
    assert calibrate.implausible(39.0, {16: 10.0, 64: 50.0}) == 64  # 39 < 0.8 × 50 = 40
    assert calibrate.implausible(40.0, {16: 10.0, 64: 50.0}) is None


def test_a_slower_small_footprint_is_remeasured_then_rejected(monkeypatch):
    # 2 MiB buffers scripted at 0.1 GB/s, then 0.2 (both below 0.8 × the 8 MiB rate): a problem
    from fxacct.tools import microbench

    monkeypatch.setitem(calibrate.COPY_SIZES, "cpu", (2**20, 4 * 2**20))
    rates = {2**20: [0.1e9, 0.2e9], 4 * 2**20: [40e9]}
    monkeypatch.setattr(microbench, "bandwidth",
                        lambda kind, nbytes, budget_s, timer=None: (rates[nbytes].pop(0),
                                                                    microbench.Timing(1.0, 0.1, 2, True)))
    warnings = []
    curve, spread = calibrate.measure_bandwidth("cpu", 0.3, warnings)
    assert curve == {2 * 2**20: 0.2e9, 8 * 2**20: 40e9} and spread == 0.1
    assert warnings == ["memory bandwidth: a 2.00 MiB footprint streamed at 0.2 GB/s twice, below 8.00 MiB's 40 GB/s"]
    # plausible the second time: no problem, the faster measurement kept
    rates.update({2**20: [0.1e9, 35e9], 4 * 2**20: [40e9]})
    warnings = []
    assert calibrate.measure_bandwidth("cpu", 0.3, warnings)[0] == {2 * 2**20: 35e9, 8 * 2**20: 40e9} and not warnings


def test_the_report_says_what_was_stored(cache):
    cal = fake_calibration(convolution_by_channels={"float32": {"8": 1e9}}, dispatch_s_per_op=2e-6,
                           spread={"matmul float32": 0.03}, warnings=["matmul float32: rejected"])
    path = calibration.save(cal)
    assert calibration.load("cpu") == cal
    from fxacct.report.calibrate_text import render_calibration

    text = render_calibration(cal, path)
    assert "convolution float32" in text and "8 channels" in text
    assert "per-op overhead" in text and "2 µs" in text and "3.0%" in text
    assert "warning: matmul float32: rejected" in text and str(path) in text


def test_latency_and_rate_come_from_two_points_of_one_op():
    # t = 10 µs + work / 1e9: at 1e6 → 1.01 ms, at 4e6 → 4.01 ms; the fit returns both
    from fxacct.tools.microbench import fit_latency

    rate, latency = fit_latency((1e6, 1.01e-3), (4e6, 4.01e-3))
    assert rate == pytest.approx(1e9) and latency == pytest.approx(1e-5)
    # a larger point no slower than the small one (noise): its own rate, no latency
    assert fit_latency((1e6, 2e-3), (4e6, 2e-3)) == (2e9, 0.0)
    # a line through the origin or below it: no latency, the large point's rate
    assert fit_latency((1e6, 1e-3), (4e6, 5e-3)) == (8e8, 0.0)


def test_convolution_curve_subtracts_the_fitted_latency():
    # times as t = 50 µs + F / rate, rate 1e9 FLOP/s at 8 channels, 4e9 at 32, 8e9 at 128; the
    # trivial op takes 2 µs, which the per-op overhead already holds: latency 48 µs per call.
    # FLOPs 2·8·C²·9·side²: (8, 8) 589,824; (8, 32) 9,437,184; (32, 32) 150,994,944; (128, 16) 603,979,776
    from fxacct.tools import microbench

    assert microbench.CONV_SHAPES == ((8, 32), (32, 32), (128, 16)) and microbench.CONV_SMALL == (8, 8)
    flops = {(8, 8): 589824, (8, 32): 9437184, (32, 32): 150994944, (128, 16): 603979776}
    rate = {8: 1e9, 32: 4e9, 128: 8e9}
    times = {(c, s): (f, 50e-6 + f / rate[c]) for (c, s), f in flops.items()}
    curve, latency = calibrate.conv_curve(times, (8, 8), 2e-6)
    assert latency == pytest.approx(48e-6)
    # each class: F / (t − 48 µs) = F / (2 µs + F / rate), close to the rate for these sizes
    assert curve == pytest.approx({str(c): flops[c, s] / (2e-6 + flops[c, s] / rate[c]) for c, s in microbench.CONV_SHAPES})


def test_the_per_op_overhead_is_what_a_measured_time_holds_beyond_the_roofline():
    # 1 ms measured, 0.4 ms of it the roofline's, over 50 ops: 12 µs per op
    from fxacct.tools import microbench

    assert microbench.per_op(1e-3, 4e-4, 50, 1e-6) == pytest.approx(1.2e-5)
    # a roofline above the measured time says nothing of the overhead: the trivial op's floor
    assert microbench.per_op(1e-3, 2e-3, 50, 1e-6) == pytest.approx(1e-6)
    assert microbench.per_op(1e-3, 0.0, 0, 3e-6) == pytest.approx(3e-6)


def test_the_small_steps_ops_as_the_prediction_charges_them(cache):
    # microbench._Tiny: 8 × (Linear(64, 64), ReLU) on 256 rows, the float sum as loss, AdamW.
    # forward + loss: 8 addmm + 8 relu + the sum and its backward seed (ones_like) = 18 ops that pay
    # the overhead; views: 8 weight transposes (t) + the seed's expand = 9.
    # backward: per layer a weight-gradient mm, its bias's sum and ReLU's threshold_backward (8 each),
    # and the input gradient's mm for every layer but the first (7): 31.
    # optimizer: AdamW's single-tensor loop per parameter (16: 8 weights, 8 biases): step += 1 and
    # the denominator's + eps (add_ ×2), weight decay and exp_avg_sq's decay (mul_ ×2), lerp_,
    # addcmul_, step.item(), sqrt, div, addcdiv_ = 10, so 160; its first step's 32 zeros_like (the
    # state) are no op of a steady-state step; views: 16 lift_fresh
    cal = fake_calibration(dispatch_s_per_op=1.0, dispatch_s_by_phase={"forward": 1.0}, view_s_per_op=1.0)
    seconds, ops, views = overhead.tiny_roofline(cal)
    assert (ops["forward"], views["forward"]) == (18, 9)
    assert ops["backward"] == 31
    assert (ops["optimizer"], views["optimizer"]) == (160, 16)
    # the roofline alone, without the overheads the calibration carries: 2·256·64·64 FLOPs per addmm
    # at 1 MFLOP/s is 2.097152 s each, and no 1 s per op is added
    assert 8 * 2.097152 <= seconds["forward"] < 8 * 2.097152 + 1


def test_calibrate_takes_the_roofline_and_the_views_out_of_the_small_step(monkeypatch):
    # the small step's phases (median) "take" 1, 2 and 3 ms; its roofline 0.2, 0.5 and 1 ms; ops 10,
    # 20, 40 and views 5, 10, 20 at the trivial op's 2 µs:
    # forward (1 − 0.2 − 5·0.002) / 10 = 0.079 ms, backward (2 − 0.5 − 10·0.002) / 20 = 0.074 ms,
    # optimizer (3 − 1 − 20·0.002) / 40 = 0.049 ms; the step (6 − 1.7 − 35·0.002) / 70 ms
    from fxacct.tools import microbench

    monkeypatch.setattr(microbench, "best_of", lambda timer, fn, budget: 2e-6)
    monkeypatch.setattr(calibrate, "measure_bandwidth", lambda kind, budget_s, warnings: ({2000: 1e9}, 0.0))
    step = microbench.Timing(6e-3, 0.0, 2, True)
    phases = {"forward": 1e-3, "backward": 2e-3, "optimizer": 3e-3}
    monkeypatch.setattr(microbench, "dispatch", lambda kind, budget_s, timer=None, profiled=False:
                        microbench.TinyTiming(step, {} if profiled else phases))
    monkeypatch.setattr(overhead, "tiny_roofline", lambda cal: (
        {"forward": 2e-4, "backward": 5e-4, "optimizer": 1e-3}, {"forward": 10, "backward": 20, "optimizer": 40},
        {"forward": 5, "backward": 10, "optimizer": 20}))
    cal = calibrate.calibrate("cpu")
    assert cal.dispatch_s_by_phase == pytest.approx({"forward": 7.9e-5, "backward": 7.4e-5, "optimizer": 4.9e-5})
    assert cal.dispatch_s_per_op == pytest.approx((6e-3 - 1.7e-3 - 35 * 2e-6) / 70)
    assert cal.view_s_per_op == pytest.approx(2e-6)
    # under the profiler every op pays one figure, views included: (6 − 1.7) / 105 ms
    assert cal.profiled_dispatch_s_per_op == pytest.approx((6e-3 - 1.7e-3) / 105)


def test_a_view_pays_the_view_overhead_and_other_ops_their_phases():
    # a calibrated CPU whose views cost 1 µs and whose forward ops cost 10 µs: the forward's and
    # the loss's overhead (the loss pays the forward's) is views × 1 µs + the other ops × 10 µs
    cal = fake_calibration(dispatch_s_per_op=5e-6, view_s_per_op=1e-6,
                           dispatch_s_by_phase={"forward": 1e-5, "backward": 1e-5, "optimizer": 1e-5})
    profile = fxacct.profile(fxacct.Config(target=TWO_LAYER))
    forward = [op for op in predict_profile(profile, from_calibration(cal)).ops if op.phase in ("forward", "loss")]
    views = [op for op in forward if op.bound == "free"]
    assert views and len(views) < len(forward)
    assert sum(op.overhead_s for op in forward) == pytest.approx(1e-6 * len(views) + 1e-5 * (len(forward) - len(views)))


def test_attention_latency_is_the_intercept_through_two_query_lengths(monkeypatch):
    # the fused CPU attention kernel "takes" 30 µs at T = 8 and 48 µs at T = 32 forward, 50 and 98 µs
    # backward; work ∝ T² (64 and 1024): forward 30 − 64 · 18/960 = 28.8 µs, backward
    # 50 − 64 · 48/960 = 46.8 µs at zero work (Hockney's α)
    from fxacct.tools import microbench
    from fxacct.trace import torch_private as tp

    times = {("fwd", 8): 30e-6, ("fwd", 32): 48e-6, ("bwd", 8): 50e-6, ("bwd", 32): 98e-6}

    class Which(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen = ("bwd" if "backward" in str(func) else "fwd", args[1].shape[2])
            return func(*args, **(kwargs or {}))

    def stable(timer, fn, budget_s):
        with Which() as which:
            fn()
        return microbench.Timing(times[which.seen], 0.0, 2, True)

    monkeypatch.setattr(microbench, "stable", stable)
    latency, spread, unfit = microbench.attention("cpu", 0.01)
    fwd, bwd = "aten._scaled_dot_product_flash_attention_for_cpu.default", \
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    assert latency == pytest.approx({fwd: 28.8e-6, bwd: 46.8e-6}) and spread == 0.0 and unfit == []
    assert microbench.attention("cuda", 0.01) == ({}, 0.0, [])  # CUDA's kernels are other ops


def test_a_contended_cpu_refuses_the_calibration(monkeypatch):
    # on 2 threads the small step "takes" 600 ms (other work holds the cores: OpenMP's threads
    # wait), on one thread 6 ms: 100× over, past CONTENDED (3×): refused, and the thread count restored
    from fxacct.tools import microbench

    monkeypatch.setattr(microbench, "best_of", lambda timer, fn, budget: 2e-6)
    monkeypatch.setattr(calibrate, "measure_bandwidth", lambda kind, budget_s, problems: ({2000: 1e9}, 0.0))

    def dispatch(kind, budget_s, timer=None, profiled=False):
        scale = 100 if torch.get_num_threads() > 1 else 1
        return microbench.TinyTiming(microbench.Timing(6e-3 * scale, 0.0, 2, True), {})

    monkeypatch.setattr(microbench, "dispatch", dispatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(UsageError, match="calibration refused, nothing stored: per-op overhead: the small "
                                             "training step took 600 ms on 2 threads and 6 ms on one"):
            calibrate.calibrate("cpu")
        assert torch.get_num_threads() == 2  # restored after the one-thread timing
    finally:
        torch.set_num_threads(threads)


def test_contention_is_judged_against_one_thread():
    assert overhead.contended(2.9e-3, 1e-3, 2) is None  # an idle machine: 1.0-1.3× measured here
    assert "other work holds this CPU's cores" in overhead.contended(3.1e-3, 1e-3, 2)
