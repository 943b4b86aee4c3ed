"""Kernels as they run on a GPU of the table (fxacct.predict.gpu_kernels) and the table's kernel fields.

Expected times are derived by hand in the comments from the published figures the model cites
(SM counts, the MAMF table, the FlashAttention-3 paper's bars, clpeak's bandwidth), never read back
from the code under test."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from click.testing import CliRunner
from helpers import ROOT, assert_one_line_exit_2, meta_input, on_meta, profile_meta

import fxacct
from fxacct.devices import DEVICES, get_device
from fxacct.predict.fused_time import predict_profile
from fxacct.predict.gpu_kernels import attention_backend, attention_rate, gemm_quantization, published_curve
from fxacct.predict.roofline import COMPUTE, MEMORY, from_gpu
from fxacct_cli.main import cli

H100 = get_device("h100")
# bf16 on the H100: peak 989.5e12 × MAMF 794.5 / 989; bandwidth 3.35e12 × clpeak 3614.60 / 4000
BF16_RATE = 989.5e12 * 794.5 / 989
H100_BW = 3.35e12 * 3614.60 / 4000


def _no_launch(device):
    return dataclasses.replace(from_gpu(device), op_overhead_s=0.0)


def _forward_mm(m: int, k: int, n: int, gpu: str = "h100"):
    # y = x @ Wᵀ in bf16, no optimizer: the forward aten.mm (its time without the launch)
    p = profile_meta(on_meta(nn.Linear, k, n, bias=False, dtype=torch.bfloat16),
                     (meta_input(m, k, dtype=torch.bfloat16),), optimizer="none")
    pr = predict_profile(p, _no_launch(get_device(gpu)))
    fwd = [o for o in pr.ops if o.op == "aten.mm.default" and o.phase == "forward"]
    assert len(fwd) == 1 and fwd[0].bound == COMPUTE, fwd
    return fwd[0]


def _forward_mm_seconds(m: int, k: int, n: int, gpu: str = "h100") -> float:
    return _forward_mm(m, k, n, gpu).seconds


# ---------------------------------------------------------------------------------------------
# GEMMs: tile and wave quantization on the SM count
# ---------------------------------------------------------------------------------------------

def test_one_tile_more_than_the_sms_takes_two_waves():
    # H100: 132 SMs. m = 7·256 = 1792, n = 19·128 = 2432: 7 · 19 = 133 tiles of 256×128 = SMs + 1,
    # so 2 waves; k = 4096. Executed: 2 · 132 · 2·256·128·4096 = 70,866,960,384 FLOPs at
    # 989.5e12 · 794.5/989 = 794.90 TFLOP/s = 89.151 µs, although the product is only
    # 2·1792·2432·4096 = 35,701,915,648 FLOPs (44.91 µs at that rate). Memory: (1792·4096 +
    # 4096·2432 + 1792·2432)·2 B = 43,319,296 B / 3.0272e12 = 14.3 µs: compute-bound.
    q = gemm_quantization(1, 1792, 2432, 4096, 132)
    assert (q.tile, q.tiles, q.split, q.waves) == ((256, 128), 133, 1, 2)
    assert q.executed_flops == 70_866_960_384
    mm = _forward_mm(1792, 4096, 2432)
    assert mm.seconds == pytest.approx(70_866_960_384 / BF16_RATE) == pytest.approx(89.151e-6, rel=1e-4)
    # the share of the bf16 peak it achieves: 35,701,915,648 FLOPs / 89.151 µs / 989.5e12 = 40.47%
    assert mm.peak_fraction == pytest.approx(35_701_915_648 / 70_866_960_384 * 794.5 / 989)
    assert mm.kernel == "gemm 256x128, 2 waves"
    # one tile fewer (n = 2304: 7·18 = 126 < 132 tiles of 256×128, so 128×128: 14·18 = 252 tiles,
    # 2 waves of 264 slots): 2 · 132 · 2·128·128·4096 = 35,433,480,192 FLOPs = 44.576 µs, half
    assert _forward_mm_seconds(1792, 4096, 2304) == pytest.approx(35_433_480_192 / BF16_RATE)


def test_a_row_past_the_tile_costs_a_whole_tile():
    # m = 12·256 = 3072, n = 11·128 = 1408: 132 tiles of 256×128, one full wave: 132 · 2·256·128·4096
    # = 35,433,480,192 FLOPs = 44.576 µs. m = 3073 (one row more): ⌈3073/256⌉ = 13 → 143 tiles,
    # 2 waves: 70,866,960,384 FLOPs = 89.151 µs, twice the time for 0.03% more work
    full, more = _forward_mm_seconds(3072, 4096, 1408), _forward_mm_seconds(3073, 4096, 1408)
    assert full == pytest.approx(35_433_480_192 / BF16_RATE)
    assert more == pytest.approx(70_866_960_384 / BF16_RATE)
    assert gemm_quantization(1, 3073, 1408, 4096, 132).tiles == 143


def test_a_small_gemm_takes_a_smaller_tile_and_splits_k():
    # 512 × 512 × 8192 on 132 SMs: 256×128 → 2·4 = 8 tiles, 128×128 → 16, 128×64 → 32, 64×64 → 64:
    # none fills the SMs, so 64×64 and K split ⌊132/64⌋ = 2 ways: one wave of slices of 4096,
    # 132 · 2·64·64·4096 = 4,429,185,024 FLOPs of SM time
    q = gemm_quantization(1, 512, 512, 8192, 132)
    assert (q.tile, q.tiles, q.split, q.waves, q.executed_flops) == ((64, 64), 64, 2, 1, 4_429_185_024)
    # batched: bmm of 4 × (1024 × 1024) on 108 SMs (A100): 256×128 → 4 · 4 · 8 = 128 ≥ 108 tiles, 2 waves
    q = gemm_quantization(4, 1024, 1024, 64, 108)
    assert (q.tile, q.tiles, q.waves, q.executed_flops) == ((256, 128), 128, 2, 2 * 108 * 2 * 256 * 128 * 64)


def test_the_sm_count_of_the_sku_sets_the_waves():
    # the same 133-tile GEMM on an A100 (108 SMs; bf16 312e12 · 271.2/312 = 271.2e12): 256×128 →
    # 133 ≥ 108 tiles, ⌈133/108⌉ = 2 waves: 2 · 108 · 2·256·128·4096 = 57,982,058,496 FLOPs = 213.80 µs
    assert _forward_mm_seconds(1792, 4096, 2432, "a100") == pytest.approx(57_982_058_496 / 271.2e12)


def test_a_convolution_is_its_implicit_gemm():
    # Conv2d(64 → 128, 3×3, padding 1, no bias) on (8, 64, 56, 56) bf16, H100: the implicit GEMM has
    # m = 8·56·56 = 25,088, n = 128, k = 64·9 = 576. 256×128 tiles: 98 < 132 SMs; 128×128: 196 ≥ 132,
    # so 128×128 in ⌈196/132⌉ = 2 waves: 2 · 132 · 2·128·128·576 = 4,982,833,152 FLOPs at 794.90
    # TFLOP/s = 6.2685 µs (the product is 2·25,088·128·576 = 3,699,376,128 FLOPs). Memory: input
    # 3,211,264 + weight 147,456 + output 6,422,528 B = 3.23 µs at 3.0272e12 B/s: compute-bound.
    model = on_meta(nn.Conv2d, 64, 128, 3, padding=1, bias=False, dtype=torch.bfloat16)
    p = profile_meta(model, (meta_input(8, 64, 56, 56, dtype=torch.bfloat16),), optimizer="none")
    pr = predict_profile(p, _no_launch(H100))
    (conv,) = [o for o in pr.ops if o.op == "aten.convolution.default"]
    assert conv.flops == 3_699_376_128 and conv.bound == COMPUTE
    assert conv.kernel == "gemm 128x128, 2 waves"
    assert conv.seconds == pytest.approx(4_982_833_152 / BF16_RATE)


# ---------------------------------------------------------------------------------------------
# Attention: backend by arch, published rates interpolated
# ---------------------------------------------------------------------------------------------

def test_attention_backend_follows_sdpa_priority():
    assert attention_backend(H100, torch.bfloat16, 128) == "cudnn"  # sm90: cuDNN first
    assert attention_backend(get_device("b200"), torch.float16, 64) == "cudnn"  # sm100
    assert attention_backend(get_device("a100"), torch.bfloat16, 128) == "flash"  # sm80: flash first
    assert attention_backend(get_device("l40s"), torch.bfloat16, 128) == "flash"  # sm89
    assert attention_backend(H100, torch.float32, 128) == "efficient"  # flash/cuDNN need fp16/bf16
    assert attention_backend(H100, torch.bfloat16, 512) == "efficient"  # head dim > 256


def test_attention_rate_interpolates_between_published_points():
    # FlashAttention-3 paper, Fig. 5, H100, FlashAttention-2, head dim 128, no mask: 350 TFLOP/s at
    # 1k and 362 at 2k. At 1448.15 = 2^10.5 (halfway in log2): 356 TFLOP/s.
    assert attention_rate(H100, "flash", "forward", False, 128, 2 ** 10.5) == pytest.approx(356e12)
    # cuDNN, forward, causal, head dim 128: 484 at 2k, 518 at 4k; 3072 = 2^11.585: 484 + 0.585·34
    assert attention_rate(H100, "cudnn", "forward", True, 128, 3072) == pytest.approx(
        (484 + (math.log2(3072) - 11) * 34) * 1e12)
    # clamped at the ends: 16k's 595 beyond it, 512's 497 below it
    assert attention_rate(H100, "cudnn", "forward", False, 128, 65536) == pytest.approx(595e12)
    assert attention_rate(H100, "cudnn", "forward", False, 128, 64) == pytest.approx(497e12)
    # no causal backward figure: the non-causal one; head dim 96 → the nearest published, 128
    assert published_curve("cudnn", "backward", True, 128)[0] == ("cudnn", "backward", False, 128)
    assert attention_rate(H100, "cudnn", "backward", True, 128, 4096) == pytest.approx(499e12)
    # but FlashAttention-2's causal backward is measured on the A100 (FA-2 paper Fig. 6, hdim 128:
    # causal 165 and non-causal 193 at 4k; 175 and 196 at 8k): the H100's non-causal bar (310 at 4k,
    # 318 at 8k) times that share; at 2^12.5 each curve interpolated in log2 first
    assert attention_rate(H100, "flash", "backward", True, 128, 4096) == pytest.approx(310e12 * 165 / 193)
    assert attention_rate(H100, "flash", "backward", True, 128, 8192) == pytest.approx(318e12 * 175 / 196)
    assert attention_rate(H100, "flash", "backward", True, 128, 2 ** 12.5) == pytest.approx(
        314e12 * 170 / 194.5)
    assert attention_rate(H100, "flash", "backward", False, 128, 4096) == pytest.approx(310e12)
    assert published_curve("flash", "forward", False, 96)[0] == ("flash", "forward", False, 128)


def test_attention_rate_on_other_skus():
    # H200: the same SMs and clocks as the H100 SXM: the same rate; B200: × 2250 / 989.5 (DERIVED)
    assert attention_rate(get_device("h200"), "cudnn", "forward", False, 128, 4096) == pytest.approx(609e12)
    assert attention_rate(get_device("b200"), "cudnn", "forward", False, 128, 4096) == pytest.approx(
        609e12 * 2.25e15 / 989.5e12)
    # A100, flash: the FlashAttention-2 paper's A100 bars (Fig. 5, FA-2, head dim 128, no mask: 157
    # TFLOP/s at 1k; Fig. 6, backward: 196 at 16k); L40S: the same × 362.05 / 312 (DERIVED)
    assert attention_rate(get_device("a100"), "flash", "forward", False, 128, 1024) == pytest.approx(157e12)
    assert attention_rate(get_device("a100"), "flash", "backward", False, 128, 16384) == pytest.approx(196e12)
    assert attention_rate(get_device("l40s"), "flash", "forward", False, 128, 1024) == pytest.approx(
        157e12 * 362.05 / 312)
    # the A100 backward has causal curves of its own: causal hdim 64 at 2k is 149 (Fig. 6c)
    assert attention_rate(get_device("a100"), "flash", "backward", True, 64, 2048) == pytest.approx(149e12)


def _causal_attention():
    """tests/models/causal_attention.py's CausalAttention (also a CLI target below)."""
    spec = importlib.util.spec_from_file_location("causal_attention", ROOT / CAUSAL_ATTENTION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CausalAttention


CAUSAL_ATTENTION = "tests/models/causal_attention.py"


def test_sdpa_in_a_step_runs_at_the_published_rate():
    # batch 1, 2 heads of 128, T = 4096, bf16, causal, on the H100 (cuDNN, a published point: no
    # interpolation). Forward: the papers' FLOPs 4 · 2 · 4096² · 128 / 2 = 8,589,934,592 at 518
    # TFLOP/s (Fig. 5, cuDNN, causal, hdim 128, 4k) = 16.583 µs. Backward: 2.5 × that = 21,474,836,480
    # at 499 TFLOP/s (Fig. 6, cuDNN, hdim 128, 4k; the causal one is not published) = 43.036 µs.
    # Memory: q, k, v, out are 2 MiB each: a few µs at 3.03e12 B/s, below.
    model = on_meta(_causal_attention(), 2, 128).to(torch.bfloat16)
    p = profile_meta(model, (meta_input(1, 4096, 256, dtype=torch.bfloat16),), optimizer="none")
    pr = predict_profile(p, _no_launch(H100))
    fwd = [o for o in pr.ops if "attention" in o.op and "backward" not in o.op]
    bwd = [o for o in pr.ops if "attention" in o.op and "backward" in o.op]
    assert len(fwd) == len(bwd) == 1
    assert fwd[0].kernel == "attention cudnn forward" and bwd[0].kernel == "attention cudnn backward"
    assert fwd[0].seconds == pytest.approx(8_589_934_592 / 518e12)
    assert bwd[0].seconds == pytest.approx(21_474_836_480 / 499e12)
    assert fwd[0].peak_fraction == pytest.approx(518 / 989.5)  # the kernel's FLOPs over the bf16 peak
    # on an A100 the same step runs flash at the FlashAttention-2 paper's A100 bars: forward causal
    # hdim 128 at 4k 148 TFLOP/s (Fig. 5d) = 58.04 µs; backward causal 165 (Fig. 6d) = 130.15 µs
    pr = predict_profile(p, _no_launch(get_device("a100")))
    (fwd,) = [o for o in pr.ops if "attention" in o.op and "backward" not in o.op]
    (bwd,) = [o for o in pr.ops if "attention" in o.op and "backward" in o.op]
    assert fwd.kernel == "attention flash forward"
    assert fwd.seconds == pytest.approx(8_589_934_592 / 148e12)
    assert bwd.seconds == pytest.approx(21_474_836_480 / 165e12)


def test_sdpa_backend_override_and_torchs_own_switch(monkeypatch):
    flash = dataclasses.replace(H100, sdpa_backend="flash")
    assert attention_backend(flash, torch.bfloat16, 128) == "flash"  # --sdpa-backend flash on sm90
    assert attention_backend(dataclasses.replace(get_device("a100"), sdpa_backend="cudnn"), torch.bfloat16, 64) == "cudnn"
    assert attention_backend(flash, torch.float32, 128) == "efficient"  # fp32 cannot run flash: torch falls back
    # torch's TORCH_CUDNN_SDPA_DEPRIORITIZED: "1" puts cuDNN last (check_env(...) != true); "0" does not
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert attention_backend(H100, torch.bfloat16, 128) == "flash"
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0")
    assert attention_backend(H100, torch.bfloat16, 128) == "cudnn"


def test_sdpa_backend_flag_times_flash_on_one_device_and_under_a_mesh():
    # the causal attention step above on the H100 with --sdpa-backend flash: FlashAttention-2's bars
    # (FlashAttention-3 paper): forward causal hdim 128 at 4k 319 TFLOP/s (Fig. 5), backward the
    # non-causal bar 310 (Fig. 6) x the causal share of FA-2's A100 backward at 4k, 165 / 193 (FA-2
    # paper Fig. 6), on the papers' FLOPs as above
    expect = {"forward": 8_589_934_592 / 319e12, "backward": 21_474_836_480 / (310e12 * 165 / 193)}
    model = str(ROOT / CAUSAL_ATTENTION) + ":CausalAttention"
    base = ["profile", model, "-k", "heads=2", "-k", "head_dim=128", "--input", "bf16[B,4096,256]", "--batch", "1",
            "--dtype", "bf16", "--optimizer", "none", "--gpu", "h100", "--format", "json", "--sdpa-backend", "flash"]
    for mesh in ((), ("--mesh", "fsdp=1")):
        doc = json.loads(_invoke(*base, *mesh).stdout)
        kernels = doc["predicted"]["kernels"]
        assert kernels["sdpa_backend"] == "flash"
        (attention,) = [k for k in kernels["by_kind"] if k["kind"].startswith("attention")]
        assert attention["kind"] == "attention flash" and attention["ops"] == 2, (mesh, attention)
        assert attention["ms"] == pytest.approx(1e3 * (expect["forward"] + expect["backward"]), rel=1e-6), mesh
    auto = json.loads(_invoke(*base[:-2]).stdout)["predicted"]["kernels"]
    assert auto["sdpa_backend"] == "auto" and any(k["kind"] == "attention cudnn" for k in auto["by_kind"])


def test_sdpa_backend_without_a_gpu_is_noted_and_a_bad_one_is_one_line_exit_2():
    doc = json.loads(_invoke("profile", TWO_LAYER, "--batch", "2", "--sdpa-backend", "flash", "--format", "json").stdout)
    assert any("--sdpa-backend flash has no effect without --gpu" in w for w in doc["warnings"])
    r = CliRunner().invoke(cli, ["profile", TWO_LAYER, "--gpu", "h100", "--sdpa-backend", "math"])
    assert_one_line_exit_2(r, "Invalid value for '--sdpa-backend': 'math' is not one of 'auto', 'cudnn', 'flash'")
    with pytest.raises(fxacct.UsageError, match="unknown --sdpa-backend 'math'"):
        fxacct.Config(sdpa_backend="math")


def test_a_masked_attention_runs_the_efficient_kernel_at_the_matmul_rate():
    # with a mask the trace's CUDA rules run the memory-efficient kernel (fxacct.trace.targets), which
    # has no published curve: its FLOPs (fxacct's count, 4·B·H·T²·d = 4·2·1024²·64 = 536,870,912
    # forward) at the bf16 full-wave GEMM rate 794.90 TFLOP/s = 0.6754 µs (memory: q, k, v, out and
    # the expanded bias, 256 KiB each and 4 MiB, above it: 1.73 µs)
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))  # so that a backward exists

        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q * self.scale, k, v, attn_mask=mask)

    args = tuple(meta_input(1, 2, 1024, 64, dtype=torch.bfloat16) for _ in range(3))
    p = profile_meta(on_meta(Masked), args + (meta_input(1024, 1024, dtype=torch.bool),), optimizer="none",
                     gpu="h100", find_max_batch=False)
    pr = predict_profile(p, _no_launch(H100))
    (fwd,) = [o for o in pr.ops if "attention" in o.op and "backward" not in o.op]
    assert fwd.op == "aten._scaled_dot_product_efficient_attention.default"
    assert fwd.kernel == "attention efficient forward"
    assert fwd.flops == 536_870_912 and fwd.bound == MEMORY  # the 4 MiB bias makes it memory-bound
    assert fwd.seconds == pytest.approx(fwd.bytes / H100_BW)


# ---------------------------------------------------------------------------------------------
# Memory-bound ops
# ---------------------------------------------------------------------------------------------

def test_a_memory_bound_op_runs_at_the_bandwidth_share():
    # relu over (4096, 4096) fp32: reads and writes 64 MiB each = 134,217,728 B at 3.35e12 ·
    # 3614.60/4000 = 3.0272e12 B/s = 44.337 µs (16.8 M FLOPs at 67e12: 0.25 µs, below)
    p = profile_meta(on_meta(nn.ReLU), (meta_input(4096, 4096),), optimizer="none")
    pr = predict_profile(p, _no_launch(H100))
    (relu,) = [o for o in pr.ops if o.op == "aten.relu.default"]
    assert relu.bound == MEMORY and relu.kernel == "memory"
    assert relu.seconds == pytest.approx(134_217_728 / H100_BW) == pytest.approx(44.337e-6, rel=1e-4)
    assert relu.peak_fraction == pytest.approx(3614.60 / 4000)


# ---------------------------------------------------------------------------------------------
# The SKU table and the CLI
# ---------------------------------------------------------------------------------------------

def test_every_sku_has_its_kernel_fields_and_their_sources():
    for key, d in DEVICES.items():
        assert d.source and d.sm_count > 0 and d.arch in ("sm80", "sm89", "sm90", "sm100"), key
        assert 0.5 < d.matmul_efficiency["bfloat16"] <= 1 and 0.5 < d.bandwidth_share <= 1, key
        for field in ("sm_count", "matmul_efficiency", "bandwidth_share", "launch_s"):
            assert d.sources.get(field), (key, field)
        assert d.peak_flops["bfloat16"] > d.peak_flops["tf32"] > d.peak_flops["float32"], key


def test_new_skus_from_their_datasheets():
    b200, l40s, h96 = get_device("b200"), get_device("l40s"), get_device("h100-96gb")
    # HGX B200 per GPU: 4.5 PFLOP/s bf16 sparse → 2.25 dense; 64 TB/s / 8 GPUs; 148 SMs
    assert (b200.peak_flops["bfloat16"], b200.bandwidth, b200.sm_count) == (2.25e15, 8.0e12, 148)
    assert b200.capacity_reported == 183359 * 2**20  # nvidia-smi memory.total
    # L40S: 733 TFLOP/s bf16 sparse → 362.05 dense (datasheet), 864 GB/s GDDR6, 18,176 cores / 128
    assert (l40s.peak_flops["bfloat16"], l40s.bandwidth, l40s.sm_count) == (362.05e12, 864e9, 142)
    # torchtitan's H100: 96 GB HBM2e at 2.4 TB/s, 500 W; bf16 between NVL 1671/2 at 400 W and SXM
    # 989.5 at 700 W, linear in power: 835.5 + 154 x 100/300 = 886.83 TFLOP/s (fp8 twice that)
    assert (h96.capacity_nominal, h96.bandwidth) == (96 * 10**9, 2.4e12)
    assert h96.peak_flops["bfloat16"] == pytest.approx(886.8333e12)
    assert h96.peak_flops["float8"] == pytest.approx(1670.5e12 + (1979e12 - 1670.5e12) / 3)
    assert h96.capacity_reported == (96 * 1024 - (81920 - 81559)) * 2**20
    assert "DERIVED" in h96.source
    assert get_device("H100-HBM2E") is h96  # an alias, any case


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


TWO_LAYER = str(ROOT / "examples/two_layer.py") + ":TwoLayer"


@pytest.mark.parametrize("gpu, name", [("b200", "NVIDIA B200 180GB"), ("l40s", "NVIDIA L40S 48GB"),
                                       ("h100-96gb", "NVIDIA H100 SXM5 96GB HBM2e (500 W)")])
def test_cli_accepts_the_new_skus(gpu, name):
    result = _invoke("profile", TWO_LAYER, "--batch", "2", "--gpu", gpu, "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["predicted"]["device"] == name
    kernels = doc["predicted"]["kernels"]
    assert kernels["sm_count"] == DEVICES[gpu].sm_count and kernels["sources"]["matmul_efficiency"]
    assert {row["kind"] for row in kernels["by_kind"]} >= {"memory"}


def test_cli_mesh_fsdp1_with_a_new_sku():
    result = _invoke("profile", TWO_LAYER, "--batch", "2", "--gpu", "b200", "--mesh", "fsdp=1", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["predicted"]["kernels"]["arch"] == "sm100"


def test_cli_unknown_gpu_is_one_line_exit_2():
    result = CliRunner().invoke(cli, ["profile", TWO_LAYER, "--gpu", "x100"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "x100" in lines[0] and "b200" in lines[0] and "l40s" in lines[0]


def test_the_text_report_names_the_kernel_model():
    text = _invoke("profile", TWO_LAYER, "--batch", "2", "--gpu", "h100").stdout
    assert "kernels (achievable rates, fxacct/predict/gpu_kernels.py): " in text
    assert "memory" in text.split("kernels (achievable rates")[1]


def test_a_real_run_forces_the_backend_it_is_timed_at():
    """--runtime with --sdpa-backend: on CUDA the run forces that kernel (torch.nn.attention.sdpa_kernel,
    whose context needs no GPU to enter); on a CPU, or with auto, it runs as torch picks."""
    import contextlib

    from torch.nn.attention import _cur_sdpa_kernel_backends

    from fxacct.runtime.run import attention_kernel

    assert isinstance(attention_kernel("flash", torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(attention_kernel("auto", torch.device("cuda")), contextlib.nullcontext)
    with attention_kernel("cudnn", torch.device("cuda")):  # the context itself needs no GPU
        assert [b.name for b in _cur_sdpa_kernel_backends()] == ["CUDNN_ATTENTION"]
