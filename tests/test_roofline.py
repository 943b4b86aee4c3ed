"""Predicted time (fxacct.predict.roofline) and the device table's units.

Expected values are computed by hand in the comments, from the datasheet figures or from a toy
device with round rates, never read back from the code under test."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner
from helpers import ROOT, config, meta_input, on_meta, profile_meta

import fxacct
from fxacct.costs.registry import Flops
from fxacct.devices import DEVICES, MiB, get_device
from fxacct.predict.fused_time import predict_profile
from fxacct.predict.roofline import (
    COMPUTE,
    FREE,
    INIT,
    MEMORY,
    PHASES,
    DeviceModel,
    for_config,
    from_gpu,
    gpu_key,
    op_seconds,
)
from fxacct.units import GB, GiB
from fxacct_cli.main import cli

TWO_LAYER = str(ROOT / "examples/two_layer.py") + ":TwoLayer"
# matmul 1e6 FLOP/s, other 1e6 FLOP/s, 1e9 B/s: a tiny model is compute-bound, 1 FLOP = 1 µs
TOY = DeviceModel("toy", {"float32": 1e6}, 1e6, 1e9, "test")


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# ---------------------------------------------------------------------------------------------
# The device table: units (TFLOP/s, GB/s, GB vs GiB) and sources
# ---------------------------------------------------------------------------------------------

def test_h100_sxm_datasheet_figures_in_their_units():
    h100 = get_device("h100")
    assert h100.peak_flops["bfloat16"] / 1e12 == pytest.approx(989.5)  # TFLOP/s, dense bf16
    assert h100.peak_flops["float8"] / 1e12 == pytest.approx(1979)  # 2 × bf16
    assert h100.peak_flops["tf32"] / 1e12 == pytest.approx(494.7)  # ½ × bf16
    assert h100.peak_flops["float32"] / 1e12 == pytest.approx(67)  # non-tensor fp32
    assert h100.bandwidth / 1e9 == pytest.approx(3350)  # 3.35 TB/s = 3350 GB/s (10^9 B)
    assert h100.capacity_nominal == 80 * GB  # "80 GB" as marketed: 80e9 B
    assert h100.capacity_nominal / GiB == pytest.approx(74.506, abs=1e-3)  # = 74.5 GiB
    assert h100.capacity_reported == 81559 * MiB  # nvidia-smi memory.total in MiB
    assert h100.capacity_reported / GiB == pytest.approx(79.647, abs=1e-3)


def test_other_table_entries():
    assert get_device("a100").peak_flops["bfloat16"] == 312e12  # A100 80GB: 312 TFLOP/s bf16 dense
    assert get_device("a100").bandwidth == 2.039e12  # 2,039 GB/s
    assert get_device("h200").capacity_nominal == 141 * GB and get_device("h200").bandwidth == 4.8e12
    pcie = get_device("h100-pcie")
    assert pcie.peak_flops["bfloat16"] == 756e12 and pcie.bandwidth == 2.0e12
    for key, d in DEVICES.items():
        assert d.source, key  # every entry names its datasheet
        assert d.peak_flops["bfloat16"] > d.peak_flops["tf32"] > d.peak_flops["float32"], key
        assert d.capacity_reported > d.capacity_nominal * 0.95, key  # MiB figure, not a GB typo


def test_tensor_core_peaks_apply_to_matmul_and_attention_only():
    h100 = from_gpu(get_device("h100"))
    # 1e12 matmul FLOPs in bf16: 1e12 / 989.5e12 s; the same in the other class: 1e12 / 67e12 s
    t, bound = op_seconds(Flops(matmul=10**12), 0, torch.bfloat16, h100)
    assert (t, bound) == (pytest.approx(1 / 989.5), COMPUTE)
    t, _ = op_seconds(Flops(attention=10**12), 0, torch.bfloat16, h100)
    assert t == pytest.approx(1 / 989.5)
    t, _ = op_seconds(Flops(other=10**12), 0, torch.bfloat16, h100)
    assert t == pytest.approx(1 / 67)
    # fp32 matmul runs at the fp32 rate (TF32 off by default for matmuls), a convolution at TF32
    assert op_seconds(Flops(matmul=10**12), 0, torch.float32, h100)[0] == pytest.approx(1 / 67)
    assert op_seconds(Flops(matmul=10**12), 0, torch.float32, h100, convolution=True)[0] == pytest.approx(1 / 494.7)
    assert op_seconds(Flops(matmul=10**12), 0, torch.float8_e4m3fn, h100)[0] == pytest.approx(1 / 1979)
    # memory-bound: 3.35e9 bytes at 3.35e12 B/s = 1 ms, above the 1 FLOP's compute time
    t, bound = op_seconds(Flops(other=1), int(3.35e9), torch.bfloat16, h100)
    assert (t, bound) == (pytest.approx(1e-3), MEMORY)


def test_bandwidth_curve_is_log_linear_between_calibrated_sizes():
    d = DeviceModel("c", {"float32": 1.0}, 1.0, 10.0, "test", bandwidth_curve=((1000, 100.0), (100000, 10.0)))
    assert d.bandwidth(10) == 100.0  # clamped below
    assert d.bandwidth(10**7) == 10.0  # clamped above
    assert d.bandwidth(10000) == pytest.approx(55.0)  # halfway in log10: 3 → 5 at 4
    assert DeviceModel("flat", {"float32": 1.0}, 1.0, 7.0, "t").bandwidth(123) == 7.0


def test_a_calibrated_matmul_rate_follows_the_smallest_dimension():
    # measured: 1e9 FLOP/s when the smallest of m, k, n is 16, 4e9 at 256 (the square's n)
    d = DeviceModel("c", {"float32": 4e9}, 4e9, 1e9, "test", matmul_curves={"float32": ((16, 1e9), (256, 4e9))})
    assert d.matmul_peak(torch.float32, min_dim=64) == pytest.approx(2.5e9)  # 64 is halfway in log 16 → 256
    assert d.matmul_peak(torch.float32, min_dim=8) == 1e9 and d.matmul_peak(torch.float32, min_dim=4096) == 4e9
    assert d.matmul_peak(torch.float32) == 4e9  # no dimension known: the square rate
    assert d.matmul_peak(torch.bfloat16, min_dim=64) == pytest.approx(2.5e9)  # uncalibrated dtype: fp32's
    # a (64×1024) @ (1024×4096) product, 2·64·1024·4096 FLOPs, at 2.5e9 FLOP/s
    t, _ = op_seconds(Flops(matmul=2 * 64 * 1024 * 4096), 0, torch.float32, d, smallest=64)
    assert t == pytest.approx(2 * 64 * 1024 * 4096 / 2.5e9)


def test_gpu_names_map_to_table_keys():
    assert gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_key("NVIDIA H100 PCIe") == "h100-pcie"
    assert gpu_key("NVIDIA H200") == "h200"
    assert gpu_key("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert gpu_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_key("Tesla T4") is None


# ---------------------------------------------------------------------------------------------
# Predicted time of a profile
# ---------------------------------------------------------------------------------------------

def test_two_layer_on_a_toy_device_by_hand():
    # TwoLayer, B=2, D=H=3, K=2, on TOY (1 FLOP = 1 µs; bytes are ~100 B = 0.1 µs: compute-bound).
    # forward: mm 36 FLOPs = 36 µs, mm_1 24 = 24 µs. backward: dW2 24 + dH 24 (→ mm_1: 48 µs),
    # dW1 36 (→ mm: 36 µs). loss: sum over 2·2 outputs = 4 FLOPs = 4 µs, + ones_like writing the
    # 4-byte fp32 seed (a creation reads nothing): 4 ns.
    p = fxacct.profile(fxacct.Config(target=TWO_LAYER, batch=2))
    pr = predict_profile(p, TOY)
    assert pr.by_node["mm"] == pytest.approx((36e-6, 36e-6))
    assert pr.by_node["mm_1"] == pytest.approx((24e-6, 48e-6))
    assert pr.by_phase["forward"] == pytest.approx(60e-6)
    assert pr.by_phase["backward"] == pytest.approx(84e-6)
    assert pr.by_phase["loss"] == pytest.approx(4e-6 + 4e-9)
    assert pr.by_module[""] == pytest.approx((60e-6, 84e-6))
    # without an optimizer the step is 60 + 4.004 + 84 = 148.004 µs
    bare = predict_profile(fxacct.profile(fxacct.Config(target=TWO_LAYER, batch=2, optimizer="none")), TOY)
    assert bare.by_phase["optimizer"] == 0
    assert bare.step_s == pytest.approx(148.004e-6)
    assert bare.step_ms == pytest.approx(0.148004)
    # AdamW's first step creates its state (zeros_like): not part of a steady-state step
    assert {o.bound for o in pr.ops if o.node.startswith("zeros_like")} == {INIT}
    assert all(o.seconds == 0 for o in pr.ops if o.bound in (FREE, INIT))


def test_op_flops_sum_to_the_account():
    # the prediction walks every op of the graph; the account sums rows of forward nodes with the
    # backward attributed to them: both must see the same FLOPs per phase
    p = fxacct.profile(config("GPT", batch=2))
    pr = predict_profile(p, from_gpu(get_device("h100")))
    flops = {phase: sum(o.flops for o in pr.ops if o.phase == phase) for phase in PHASES}
    t = p.accounting.totals
    assert flops == {"forward": t.forward.total, "loss": t.loss_flops, "backward": t.backward.total,
                     "optimizer": t.optimizer_flops}
    # no forward or backward op is left without a node to carry its time (an orphan backward op
    # goes to a forward node, never nowhere)
    node_f = sum(f for f, _ in pr.by_node.values())
    node_b = sum(b for _, b in pr.by_node.values())
    assert (node_f, node_b) == pytest.approx((pr.by_phase["forward"], pr.by_phase["backward"]))


@pytest.mark.parametrize("m, bound", [(4096, COMPUTE), (1, MEMORY)])
def test_one_linear_on_an_h100_by_hand(m, bound):
    # y = x @ Wᵀ, x (m, 4096), W (4096, 4096) fp32, no bias, no optimizer, on the H100's achievable
    # rates (fxacct.predict.gpu_kernels): fp32 matmuls at the fp32 peak 67e12 (TF32 off) × cuBLAS's
    # measured share 794.5 / 989 (MAMF table), memory at 3.35e12 B/s × 3614.60 / 4000 (clpeak);
    # an op takes max(compute, memory).
    # m = 4096, forward mm: (1, 4096, 4096, 4096); 256×128 tiles: 16 · 32 = 512 ≥ 132 SMs, so that
    #   tile; waves ⌈512 / 132⌉ = 4; executed 4 · 132 · 2 · 256 · 128 · 4096 = 141,733,920,768 FLOPs
    #   / (67e12 · 794.5/989) = 2.6333 ms > 201,326,592 B / 3.0272e12 = 66.5 µs: compute
    # m = 1: a matrix-vector product (gemv): 33,554,432 FLOPs / 67e12 = 0.50 µs < 67,141,632 B /
    #   3.0272e12 = 22.18 µs: memory
    # backward: dW = dyᵀ @ x, (4096 × m) @ (m × 4096), the same bytes; for m = 4096 the same GEMM;
    #   for m = 1 an outer product (k = 1): 512 tiles, 4 waves, 528 · 2 · 32768 · 1 FLOPs = 0.64 µs
    #   < 22.18 µs: memory, as the forward
    # loss: sum over y, m·4096 FLOPs at 67e12 vs (m·4096·4 + 4) B: memory; ones_like writes 4 B
    # (the per-op overhead is off here: test_the_per_op_overhead_is_ops_times_overhead adds it)
    import dataclasses

    k = n = 4096
    p = profile_meta(on_meta(nn.Linear, k, n, bias=False), (meta_input(m, k),), optimizer="none")
    pr = predict_profile(p, dataclasses.replace(from_gpu(get_device("h100")), op_overhead_s=0.0))
    bw, rate = 3.35e12 * 3614.60 / 4000, 67e12 * 794.5 / 989
    memory = (m * k + k * n + m * n) * 4 / bw
    compute = 141_733_920_768 / rate if m == 4096 else 2 * k * n / 67e12
    mm = max(compute, memory)
    loss = max(m * n / 67e12, (m * n * 4 + 4) / bw) + 4 / bw
    assert [o.bound for o in pr.ops if o.op == "aten.mm.default"] == [bound, bound]
    assert pr.by_phase == pytest.approx({"forward": mm, "loss": loss, "backward": mm, "optimizer": 0.0})
    assert pr.by_node["mm"] == pytest.approx((mm, mm))
    assert pr.by_module[""] == pytest.approx((mm, mm))
    assert pr.step_s == pytest.approx(2 * mm + loss)
    if m == 4096:  # 2.6333 ms, against the datasheet roofline's 137,438,953,472 / 67e12 = 2.0513 ms
        assert mm == pytest.approx(2.6333e-3, rel=1e-4)


def test_replayed_blocks_predict_the_same_as_traced_ones():
    import dataclasses

    h100 = from_gpu(get_device("h100"))
    preds = [predict_profile(fxacct.profile(dataclasses.replace(config("GPT", batch=2), dedup=d)), h100)
             for d in (True, False)]
    assert [(o.node, o.op, o.seconds) for o in preds[0].ops] == [(o.node, o.op, o.seconds) for o in preds[1].ops]
    assert preds[0].by_module == preds[1].by_module


def test_cli_fills_predicted_step_ms_with_a_gpu():
    result = invoke("profile", TWO_LAYER, "--batch", "2", "--gpu", "h100", "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["totals"]["predicted_step_ms"] > 0
    assert doc["predicted"]["step_ms"] == doc["totals"]["predicted_step_ms"]
    assert doc["predicted"]["device"] == "NVIDIA H100 SXM5 80GB"
    assert "runtime" not in doc  # only with --runtime


def test_uncalibrated_cpu_has_no_predicted_time():
    assert for_config(fxacct.Config(target=TWO_LAYER)) is None
    result = invoke("profile", TWO_LAYER, "--batch", "2", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["totals"]["predicted_step_ms"] is None
    text = invoke("profile", TWO_LAYER, "--batch", "2").stdout
    assert "not calibrated" in text
    text = invoke("profile", TWO_LAYER, "--batch", "2", "--gpu", "a100").stdout
    assert "predicted step time on NVIDIA A100 SXM4 80GB (roofline" in text


def test_runtime_flags_without_runtime_are_a_usage_error():
    result = invoke("profile", TWO_LAYER, "--steps", "3")
    assert result.exit_code == 2
    assert "--runtime" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_per_op_overhead_is_ops_times_overhead():
    # closed form: the step with an overhead of h seconds per op is the step without it plus
    # (number of ops) × h, the ops counted from the graph itself (every call_function node but the
    # views, which launch no kernel on a GPU; no optimizer here, so no state init and no repeat);
    # the report prints it as its own line
    import dataclasses

    from fxacct.devices import LAUNCH_S
    from fxacct.report.runtime_text import predicted_section

    p = profile_meta(on_meta(nn.Linear, 64, 32, bias=False), (meta_input(8, 64),), optimizer="none")
    gpu = from_gpu(get_device("h100"))
    assert gpu.op_overhead_s == LAUNCH_S == 4e-6  # the table's kernel launch latency (sourced there)
    ops = sum(1 for n in p.capture.graph.nodes if n.op == "call_function" and n.meta["fxacct"].kind != "view")
    assert any(n.meta["fxacct"].kind == "view" for n in p.capture.graph.nodes if n.op == "call_function")
    h = 1e-3
    bare = predict_profile(p, dataclasses.replace(gpu, op_overhead_s=0.0))
    paid = predict_profile(p, dataclasses.replace(gpu, op_overhead_s=h, overhead_source="test"))
    assert ops > 3 and paid.overhead_ops == ops
    assert paid.overhead_s == pytest.approx(ops * h)
    assert paid.step_s == pytest.approx(bare.step_s + ops * h)
    for phase in PHASES:  # each phase pays for its own ops
        n_phase = sum(1 for n in p.capture.graph.nodes
                      if n.op == "call_function" and n.meta["fxacct"].phase == phase and n.meta["fxacct"].kind != "view")
        assert paid.by_phase[phase] == pytest.approx(bare.by_phase[phase] + n_phase * h)
    line = [x for x in predicted_section(paid).splitlines() if "per-op overhead" in x]
    assert line == [f"  per-op overhead: {ops} ops × 1 ms = {ops:.3g} ms "
                    f"({100 * ops * h / paid.step_s:.1f}% of the time; test)"]
    assert "none counted" in predicted_section(bare)


def test_a_convolution_runs_at_the_calibrated_rate_of_its_channels():
    # Conv2d(8 -> 8, 3×3, padding 1, no bias) on (1, 8, 4, 4), no optimizer; calibrated convolution
    # rates 1e6 FLOP/s at 8 channels, 4e6 at 32; memory free (1e18 B/s), no per-op overhead.
    # forward: 2·1·8·8·9·4·4 = 18,432 FLOPs at the 8-channel rate = 18.432 ms (not the 1e12 matmul rate)
    import dataclasses

    from fxacct.predict.calibration import Calibration
    from fxacct.predict.roofline import from_calibration, min_dim

    cal = Calibration("cpu", "toy", 1, "x", {"float32": 1e12}, {}, 1e18, {"1000": 1e18}, "t", {}, 0.0,
                      convolution_by_channels={"float32": {"8": 1e6, "32": 4e6}})
    p = profile_meta(on_meta(nn.Conv2d, 8, 8, 3, padding=1, bias=False), (meta_input(1, 8, 4, 4),), optimizer="none")
    device = from_calibration(cal)
    assert device.op_overhead_s == 0.0 and "not calibrated" in device.overhead_source
    pr = predict_profile(p, device)
    (conv,) = [o for o in pr.ops if o.op == "aten.convolution.default"]
    assert conv.flops == 18432 and conv.seconds == pytest.approx(18.432e-3)
    convs = [n for n in p.capture.graph.nodes if "convolution" in str(n.target)]
    assert {min_dim(n) for n in convs} == {8}  # forward and backward: the weight's 8 → 8 channels
    # between calibrated channel counts: log-linear, 16 channels halfway (in log) from 1e6 to 4e6
    assert dataclasses.replace(device).matmul_peak(torch.float32, True, 16) == pytest.approx(2.5e6)


def test_the_cnn_example_is_costed_in_full():
    # examples/cnn.py: Conv + BatchNorm + ReLU + MaxPool ×3, dropout, fc; parameters by hand
    # (docstring): 3·16·9 + 16·32·9 + 32·64·9 + 2·(16 + 32 + 64) + 64·4·4·10 + 10 = 33,946
    p = fxacct.profile(fxacct.Config(target=str(ROOT / "examples/cnn.py") + ":CNN", batch=2))
    assert p.accounting.totals.params == 33946
    assert not p.accounting.unsupported_ops


def test_a_calibrated_kernel_runs_at_its_measured_rate():
    # MaxPool2d(2) after a 1×1 conv on (1, 8, 4, 4); the calibration says max_pool2d_with_indices
    # moves 1e6 B/s. Its bytes: reads 1·8·4·4·4 = 512 B, writes values 8·2·2·4 = 128 B and int64
    # indices 8·2·2·8 = 256 B: 896 B / 1e6 B/s = 896 µs, whatever the streaming bandwidth (1e18)
    from fxacct.predict.calibration import Calibration
    from fxacct.predict.roofline import from_calibration

    cal = Calibration("cpu", "toy", 1, "x", {"float32": 1e12}, {}, 1e18, {"1000": 1e18}, "t", {}, 0.0,
                      kernel_bytes_per_s={"aten.max_pool2d_with_indices.default": 1e6})
    model = on_meta(lambda: nn.Sequential(nn.Conv2d(8, 8, 1), nn.MaxPool2d(2)))
    p = profile_meta(model, (meta_input(1, 8, 4, 4),), optimizer="none")
    pr = predict_profile(p, from_calibration(cal))
    (pool,) = [o for o in pr.ops if o.op == "aten.max_pool2d_with_indices.default"]
    assert pool.bytes == 896 and pool.seconds == pytest.approx(896e-6) and pool.bound == MEMORY


def test_a_convolution_backward_uses_its_own_curve_and_every_call_pays_its_latency():
    # the Conv2d(8 -> 8) of the test above on (1, 8, 4, 4), input without grad: the backward computes
    # the weight gradient only, 18,432 FLOPs (as the forward). Calibrated: forward 1e6 FLOP/s at 8
    # channels, backward 2e6, latencies 1 ms (forward) and 3 ms (backward); memory free, no overhead.
    # forward 18,432 / 1e6 + 1e-3 = 19.432 ms; backward 18,432 / 2e6 + 3e-3 = 12.216 ms
    from fxacct.predict.calibration import Calibration
    from fxacct.predict.roofline import from_calibration

    cal = Calibration("cpu", "toy", 1, "x", {"float32": 1e12}, {}, 1e18, {"1000": 1e18}, "t", {}, 0.0,
                      convolution_by_channels={"float32": {"8": 1e6}},
                      convolution_backward_by_channels={"float32": {"8": 2e6}},
                      op_latency_s={"aten.convolution.default": 1e-3, "aten.convolution_backward.default": 3e-3})
    p = profile_meta(on_meta(nn.Conv2d, 8, 8, 3, padding=1, bias=False), (meta_input(1, 8, 4, 4),), optimizer="none")
    pr = predict_profile(p, from_calibration(cal))
    (fwd,) = [o for o in pr.ops if o.op == "aten.convolution.default"]
    (bwd,) = [o for o in pr.ops if o.op == "aten.convolution_backward.default"]
    assert fwd.seconds == pytest.approx(19.432e-3)
    assert bwd.flops == 18432 and bwd.seconds == pytest.approx(12.216e-3)


def test_the_per_op_overhead_by_phase_is_each_phase_ops_times_its_own():
    # closed form: overhead 1 ms per forward (and loss) op, 2 ms per backward op, none for the
    # optimizer's (none here): the step is the bare step plus 1 ms × forward and loss ops + 2 ms ×
    # backward ops, the ops counted per phase from the graph itself
    import dataclasses

    p = profile_meta(on_meta(nn.Linear, 64, 32, bias=False), (meta_input(8, 64),), optimizer="none")
    gpu = from_gpu(get_device("h100"))
    count = {ph: sum(1 for n in p.capture.graph.nodes if n.op == "call_function" and n.meta["fxacct"].phase == ph
                     and n.meta["fxacct"].kind != "view") for ph in PHASES}  # a view launches no kernel
    bare = predict_profile(p, dataclasses.replace(gpu, op_overhead_s=0.0))
    paid = predict_profile(p, dataclasses.replace(gpu, op_overhead_s=5.0, overhead_by_phase={
        "forward": 1e-3, "backward": 2e-3}))
    assert count["forward"] and count["loss"] and count["backward"]
    expected = 1e-3 * (count["forward"] + count["loss"]) + 2e-3 * count["backward"]
    assert paid.overhead_s == pytest.approx(expected)
    assert paid.step_s == pytest.approx(bare.step_s + expected)
