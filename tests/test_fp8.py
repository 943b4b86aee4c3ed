"""Float8 training (``--fp8 tensorwise|rowwise``, issue 23 item 4): the linear layers become
torchao's Float8Linear, whose casts, scales and ``aten._scaled_mm`` are traced as they run.
Oracles: a closed form and torch's FlopCounterMode for the ``_scaled_mm`` FLOPs, and a real eager
step of the same converted model on CPU (``saved_tensors_hooks`` for what autograd saves,
fxacct's storage tracker for the op-level peak)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner
from helpers import eager_saved_bytes, real_model, target
from parallel_oracle import predicted_by_op
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import fxacct
from fxacct.load import fp8
from fxacct.runtime.gloo_run import run_mesh
from fxacct.runtime.storage_tracker import default_loss, measure_training_step
from fxacct_cli.main import cli

pytest.importorskip("torchao")

LLAMA = "examples/llama.py:Llama"
SCALED_MM = torch.ops.aten._scaled_mm.default
TOKENS = 2 * 64  # batch 2, max_seq 64

# examples/llama.py's defaults: every nn.Linear has dimensions that are multiples of 16, so all 15
# are converted. Σ in·out per layer: wq 64·64 + wk 64·32 + wv 64·32 + wo 64·64 + w1, w3 64·128 each
# + w2 128·64 = 36,864; 2 layers and the output 64·512: 106,496. Each linear runs three _scaled_mm
# per step (output, grad_input, grad_weight), each 2·tokens·in·out FLOPs.
LINEAR_MACS = 2 * 36_864 + 64 * 512
SCALED_MM_FLOPS = 3 * 2 * TOKENS * LINEAR_MACS  # 81,788,928


class _Desugared(TorchDispatchMode):
    """Lets torchao's float8 tensor desugar an op first, so the modes below see its _scaled_mm."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, fp8.float8_tensor_type()) for t in types):
            return NotImplemented
        return func(*args, **(kwargs or {}))


def converted(recipe: str, dtype=None):
    model, args, kwargs = real_model(LLAMA, {}, 2, dtype)
    fp8.convert(model, recipe)
    return model, args, kwargs


def scaled_mm_nodes(p) -> list:
    return [n for n in p.capture.graph.nodes if n.target is SCALED_MM]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_flops_equal_flop_counter_and_the_closed_form(recipe):
    p = fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, fp8=recipe))
    nodes = scaled_mm_nodes(p)
    assert len(nodes) == 3 * 15
    traced = sum(n.meta["fxacct"].flops.total for n in nodes)
    model, args, kwargs = converted(recipe)
    with FlopCounterMode(display=False) as counter, _Desugared():
        default_loss(model(*args, **kwargs)).backward()
    counted = counter.get_flop_counts()["Global"]
    assert traced == counted[torch.ops.aten._scaled_mm] == SCALED_MM_FLOPS
    assert torch.ops.aten.mm not in counted  # every matmul of the model ran as _scaled_mm
    # the casts to float8 are in the graph: e4m3 tensors made in the forward and the backward
    float8 = {n.meta["fxacct"].phase for n in p.capture.graph.nodes if n.op == "call_function"
              and any(getattr(t, "dtype", None) == torch.float8_e4m3fn for t in _metas(n))}
    assert float8 == {"forward", "backward"}


def _metas(node):
    val = node.meta.get("val")
    return val if isinstance(val, tuple) else (val,)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, dtype", [("tensorwise", None), ("rowwise", None), ("rowwise", torch.bfloat16)])
def test_activation_bytes_and_peak_equal_an_eager_step(recipe, dtype):
    """What autograd saves equals a real eager forward of the converted model (torchao saves the
    high-precision input and weight and casts again in the backward), and the training peak is
    within 2% of the storage tracker's op-level peak of a real steady-state step."""
    p = fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, fp8=recipe, dtype=dtype))
    model, args, kwargs = converted(recipe, dtype)
    saved, _ = eager_saved_bytes(model, args, kwargs)
    assert p.accounting.totals.activation_bytes == saved
    measured = measure_training_step(model, args, torch.optim.AdamW, kwargs=kwargs).peak_bytes
    predicted = p.memory.peak_train.bytes
    assert abs(measured - predicted) <= 0.02 * predicted, (measured, predicted)


def test_fp8_activation_bytes_equal_an_eager_forward():
    """The fast tier's check of the above: rowwise, float32 (1,285,632 B here)."""
    p = fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, fp8="rowwise"))
    saved, _ = eager_saved_bytes(*converted("rowwise"))
    assert p.accounting.totals.activation_bytes == saved


SAME = ("forward_flops", "backward_flops", "forward_flops_by_class", "backward_flops_by_class", "activation_bytes",
        "params", "param_bytes", "grad_bytes", "optimizer_bytes", "peak_train_bytes", "peak_inference_bytes")


def profile_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["profile", LLAMA, "--batch", "2", *args, "--format", "json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_fp8_flag_reaches_one_device_and_a_mesh_of_one():
    """--fp8 through the CLI on one device, --mesh fsdp=1 and --mesh dp=1 (no engine applied at
    size 1): the same account; and it moves the account against the plain step."""
    one = profile_json("--fp8", "rowwise")
    assert one["config"]["fp8"] == "rowwise"
    for mesh in ("fsdp=1", "dp=1"):
        ranked = profile_json("--fp8", "rowwise", "--mesh", mesh)
        assert {k: ranked["totals"][k] for k in SAME} == {k: one["totals"][k] for k in SAME}, mesh
    plain = profile_json()
    assert plain["totals"]["peak_train_bytes"] != one["totals"]["peak_train_bytes"]


def test_fp8_bad_recipe_is_one_line_exit_2():
    result = CliRunner().invoke(cli, ["profile", LLAMA, "--fp8", "e5m2"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "tensorwise, rowwise" in lines[0], lines


def test_fp8_without_torchao_is_one_line_exit_2(monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find(name, *a))
    result = CliRunner().invoke(cli, ["profile", LLAMA, "--fp8", "rowwise"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "pip install 'fxacct[fp8]'" in lines[0], lines


@pytest.mark.slow
def test_fp8_under_fsdp2_matches_a_real_gloo_run():
    """--fp8 rowwise at --mesh fsdp=2: the Float8Linear model under FSDP2 runs for real in 2 gloo
    processes; each rank's collectives equal the account's (FSDP2 gathers the high-precision
    weights: 5 all-gathers, 3 reduce-scatters) and its op-level peak is within 2% (1.000 here)."""
    cfg = fxacct.Config(target=target(LLAMA), batch=2, fp8="rowwise", mesh="fsdp=2")
    p = fxacct.profile(cfg)
    predicted = predicted_by_op(p.parallel.rows)
    assert {op: c for op, (c, _) in predicted.items()} == {"all_gather": 5, "reduce_scatter": 3}
    for m in run_mesh(cfg, steps=1, warmup=1):
        assert m.collectives == predicted, (m.rank, m.collectives)
        assert abs(m.op_level_peak_bytes - p.memory.peak_train.bytes) <= 0.02 * p.memory.peak_train.bytes


@pytest.mark.parametrize("mesh", [(), ("--mesh", "fsdp=1")])
def test_fp8_with_float8_parameters_is_one_line_exit_2(mesh):
    """--fp8 casts high-precision weights to float8 for each matmul: float8 parameters (--dtype fp8)
    leave nothing to cast from; told before any trace, on one device and under a mesh alike."""
    result = CliRunner().invoke(cli, ["profile", LLAMA, "--fp8", "rowwise", "--dtype", "fp8", *mesh])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--dtype float8_e4m3fn" in lines[0] and "--dtype bf16" in lines[0], lines
