"""Every flag reaches every path (issue 21): each option that shapes the step, run through the CLI
on one device and under ``--mesh fsdp=1`` and ``--mesh tp=1``, gives the one-device account.

DESIGN.md: "a flag reaches one device, a rank and a stage through the same Config and the same
step: ``--mesh fsdp=1`` gives the single-device account". A path that dropped a flag (the mesh once
dropped --loss: GPT-2's cross-entropy counted 128,000 loss FLOPs, the default sum's, not 1,280,642)
fails here, as long as the flag moves the account: ``test_each_flag_moves_the_account`` checks that
each one does, on the quantities compared.

Paths: GPT-2 (tied wte/lm_head) under a mesh of size 1 has no engine applied (fxacct shards only a
dim > 1), so every figure, peaks included, must equal one device's. Llama goes through its own
``examples/llama.py:parallelize``, which at ``fsdp=1`` does apply FSDP2 (a one-rank
``fully_shard``): FLOPs, activations and the parameter/gradient/optimizer bytes still equal one
device's, and the differences the engine really makes are named and sized in
``test_fsdp2_one_rank_gathers_into_unsharded_copies``; at ``tp=1`` it applies nothing.

Each distinct command line is traced once per module (``runs``, keyed by the arguments).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers import on_meta

from examples.gpt2 import GPT
from examples.llama import Llama
from fxacct.devices import get_device
from fxacct_cli.main import cli

GPT_KWARGS = dict(n_layer=2, n_embd=64, n_head=4, block_size=64, vocab_size=1000)
GPT_ARGS = ("examples/gpt2.py:GPT", *(a for k, v in GPT_KWARGS.items() for a in ("-k", f"{k}={v}")), "--batch", "2")
LLAMA_ARGS = ("examples/llama.py:Llama", "--batch", "2")  # its defaults: vocab 512, dim 64, 2 layers, T = 64
MLP_ARGS = ("examples/mlp.py:MLP", "-k", "d_model=64", "-k", "d_hidden=128", "-k", "n_blocks=2", "--batch", "2")
LLAMA_PARALLELIZE = ("--parallelize", "examples/llama.py:parallelize")

MODELS = {  # id -> (the target's arguments, its block glob for --checkpoint, the flags every --mesh run adds)
    "gpt2": (GPT_ARGS, "h.*", ()),
    "llama": (LLAMA_ARGS, "layers.*", LLAMA_PARALLELIZE),
}
MESHES = ("fsdp=1", "tp=1")

# id -> (flags, the totals key the flag moves on one device against the default step)
FLAGS = {
    "default": ((), None),
    "loss-cross-entropy": (("--loss", "cross-entropy"), "loss_flops"),
    "loss-mse": (("--loss", "mse"), "loss_flops"),
    "dtype-bf16": (("--dtype", "bf16"), "activation_bytes"),
    "amp-bf16": (("--amp", "bf16"), "activation_bytes"),
    "master-weights": (("--dtype", "bf16", "--master-weights"), "master_weight_bytes"),
    "optimizer-sgd": (("--optimizer", "sgd"), "optimizer_bytes"),
    "optimizer-adagrad": (("--optimizer", "adagrad"), "optimizer_flops"),
    "checkpoint": (("--checkpoint", "{block}"), "activation_bytes"),
    "gpu-h100": (("--gpu", "h100"), "activation_bytes"),  # GPU kernel rules: what attention saves
    "causal-halved": (("--causal-attention", "halved"), "forward_flops"),
    "input-requires-grad": (("--input-requires-grad",), "backward_flops"),  # on MLP: token inputs take no grad
    "compile": (("--compile",), "activation_bytes"),  # the partitioner saves other tensors than eager
    "compile-blocks": (("--compile-blocks", "{block}"), "recompute_flops"),  # each block compiled: the partitioner recomputes cheap ops
    "compile-blocks-checkpoint": (("--compile-blocks", "{block}", "--checkpoint", "{block}"), "activation_bytes"),
}

# The account's figures a path must not change (by_class dicts included): FLOPs by phase and class,
# what autograd saves, and the bytes of the model's state
SAME = ("forward_flops", "backward_flops", "loss_flops", "forward_flops_by_class", "backward_flops_by_class",
        "activation_bytes", "loss_activation_bytes", "params", "trainable_params", "param_bytes", "grad_bytes",
        "optimizer_bytes", "optimizer_flops", "master_weight_bytes", "recompute_flops", "checkpoint_bytes")
PEAKS = ("peak_train_bytes", "peak_inference_bytes", "peak_reserved_bytes")


@pytest.fixture(scope="module")
def runs():
    """``runs(*args)``: the CliRunner result of ``fxacct profile ARGS --format json``, each distinct
    command traced once in this module."""
    cache: dict[tuple, object] = {}

    def run(*args: str):
        if args not in cache:
            cache[args] = CliRunner().invoke(cli, ["profile", *args, "--format", "json"], catch_exceptions=False)
        return cache[args]

    return run


def command(model: str, flag: str, mesh: str | None) -> tuple[str, ...]:
    target, block, parallelize = MODELS[model] if model in MODELS else (MLP_ARGS, "blocks.*", ())
    flags = tuple(f.format(block=block) for f in FLAGS[flag][0])
    return (*target, *flags, *(("--mesh", mesh, *parallelize) if mesh else ()))


def totals(runs, *args: str) -> dict:
    result = runs(*args)
    assert result.exit_code == 0, f"fxacct profile {' '.join(args)}: exit {result.exit_code}\n{result.output}"
    return json.loads(result.stdout)["totals"]


def engine_applied(model: str, mesh: str) -> bool:
    """Whether the mesh run wraps the model in an engine: Llama's parallelize shards at fsdp=1
    (one-rank FSDP2); a tp of 1 and fxacct's own default at size 1 apply nothing."""
    return model == "llama" and mesh == "fsdp=1"


# the fast tier (pytest -m "not slow") keeps GPT-2's every flag and Llama's default step (its FSDP2 path)
CASES = [pytest.param(model, flag, mesh, id=f"{model}-{flag}-{mesh}",
                      marks=[pytest.mark.slow] if model == "llama" and flag != "default" else [])
         for model in MODELS for flag in FLAGS if flag != "input-requires-grad" for mesh in MESHES]
CASES += [pytest.param("mlp", flag, mesh, id=f"mlp-{flag}-{mesh}") for flag in ("default", "input-requires-grad")
          for mesh in MESHES]


@pytest.mark.parametrize("model, flag, mesh", CASES)
def test_mesh_of_one_gives_the_one_device_account(runs, model, flag, mesh):
    if flag == "master-weights":
        result = runs(*command(model, flag, mesh))
        # --mesh refuses --master-weights (its fp32 copies would sit beside the engine's shards):
        # a usage error, one line, that names both flags and the way out
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --master-weights with --mesh {mesh}:"), lines
        assert "--amp bfloat16 instead" in lines[0], lines
        return
    if flag == "compile":
        result = runs(*command(model, flag, mesh))
        # the whole model compiled would trace the engine's hooks into its graph: a one-line usage
        # error pointing to --compile-blocks (test_compile.py checks those against real gloo runs)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "--compile under --mesh" in lines[0] and "--compile-blocks" in lines[0], lines
        return
    one = totals(runs, *command(model, flag, None))
    ranked = totals(runs, *command(model, flag, mesh))
    assert {k: ranked[k] for k in SAME} == {k: one[k] for k in SAME}
    if not engine_applied(model, mesh):
        assert {k: ranked[k] for k in PEAKS} == {k: one[k] for k in PEAKS}


@pytest.mark.parametrize("mesh", (None, "fsdp=1"))
def test_alloc_conf_reaches_one_device_and_a_rank(runs, mesh):
    """--alloc-conf (Config.alloc_conf) reaches the allocator replay on one device and through the
    mesh path alike: expandable segments move GPT-2's reserved peak, the same on both paths (no
    engine at fsdp=1), and the string is echoed."""
    extra = ("--mesh", mesh) if mesh else ()
    conf = ("--alloc-conf", "expandable_segments:True")
    default = totals(runs, *GPT_ARGS, "--gpu", "h100", "--alloc-conf", "expandable_segments:False", *extra)
    expandable = totals(runs, *GPT_ARGS, "--gpu", "h100", *conf, *extra)
    assert expandable["peak_reserved_bytes"] != default["peak_reserved_bytes"]
    one = totals(runs, *GPT_ARGS, "--gpu", "h100", *conf)
    assert expandable["peak_reserved_bytes"] == one["peak_reserved_bytes"]
    doc = json.loads(runs(*GPT_ARGS, "--gpu", "h100", *conf, *extra).stdout)
    assert doc["memory"]["reserved"]["alloc_conf"] == "expandable_segments:True"


def test_each_flag_moves_the_account(runs):
    """Parity can only catch a dropped flag if the flag changes what is compared: each flag moves
    its named figure on one device (input-requires-grad on MLP, whose float input can take a
    gradient; GPT-2 and Llama take token ids)."""
    unmoved = []
    for flag, (_, key) in FLAGS.items():
        if key is None:
            continue
        for model in (("mlp",) if flag == "input-requires-grad" else MODELS):
            if totals(runs, *command(model, flag, None))[key] == totals(runs, *command(model, "default", None))[key]:
                unmoved.append(f"{model} {flag}: {key}")
    assert not unmoved


def test_acceptance_loss_flops(runs):
    """GPT-2 small above: logits [B=2, T=64, V=1000], so N = 128 rows of C = 1000 classes,
    n = N·C = 128,000 elements. The registry's formulas (fxacct/costs/losses.py, norms.py), with
    targets [2, 64] (mean reduction, no class weights) for cross-entropy:
      _log_softmax forward        5n + N     = 640,000 + 128     = 640,128  (amax, sub, exp, sum, sub; log per row)
      nll_loss_forward            2N + N + 1 = 256 + 128 + 1     =     385  (pick, ignore mask; sum; / weight)
      nll_loss_backward           N + n + 1  = 128 + 128,000 + 1 = 128,129  (mask, one-hot · grad, / weight)
      _log_softmax_backward_data  4n                             = 512,000  (exp, sum, mul, sub)
                                                                   1,280,642
    mse against a float target [2, 64, 1000]: mse_loss 2n + n (sub, square, mean) = 384,000 and
    mse_loss_backward 3n = 384,000, so 768,000. The default loss, ``logits.float().sum()``, is one
    reduction: n = 128,000 (the .float() of a float32 tensor and the ones_like seed are 0 FLOPs).
    The same on every path (fsdp=1, tp=1 and a real shard, fsdp=2)."""
    for mesh in (None, *MESHES, "fsdp=2"):
        extra = ("--mesh", mesh) if mesh else ()
        assert totals(runs, *GPT_ARGS, "--loss", "cross-entropy", *extra)["loss_flops"] == 1_280_642, mesh
        assert totals(runs, *GPT_ARGS, "--loss", "mse", *extra)["loss_flops"] == 768_000, mesh
        assert totals(runs, *GPT_ARGS, *extra)["loss_flops"] == 128_000, mesh


def test_tied_weight_counted_once_under_a_mesh(runs):
    """GPT-2 ties lm_head.weight to wte.weight: one parameter, whose gradient sums the embedding's
    and the head's (one add of V·C elements). Under --mesh with no engine applied, the model is
    materialized with to_empty, which unties (each module gets its own new Parameter); the rank
    capture ties it again. Untied, the mesh run counted V·C = 64,000 more parameters and 64,000 fewer
    backward FLOPs."""
    model = on_meta(GPT, **GPT_KWARGS)
    distinct = sum(p.numel() for p in model.parameters())  # tied weights once
    vocab, width = GPT_KWARGS["vocab_size"], GPT_KWARGS["n_embd"]
    assert sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False)) == distinct + vocab * width
    for mesh in MESHES:
        t = totals(runs, *GPT_ARGS, "--mesh", mesh)
        assert (t["params"], t["param_bytes"]) == (distinct, 4 * distinct), mesh


def test_fsdp2_one_rank_gathers_into_unsharded_copies(runs):
    """What FSDP2 at one rank really changes (Llama, examples/llama.py:parallelize): its all-gather
    copies each unit's parameters into a separate unsharded storage even at world size 1, so memory
    holds them beside the (whole) shards. At the inference peak (the same node inside a block's
    forward as on one device) that is the root unit (tok_embeddings, norm, output; kept gathered
    after forward: reshard_after_forward=False) and the one block being run (resharded after its
    forward), in the parameters' dtype."""
    model = on_meta(Llama)
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    block = sum(p.numel() for p in model.layers["0"].parameters())
    for flag, size in (("default", 4), ("dtype-bf16", 2), ("optimizer-sgd", 4), ("checkpoint", 4)):
        one = totals(runs, *command("llama", flag, None))
        fsdp = totals(runs, *command("llama", flag, "fsdp=1"))
        assert fsdp["peak_inference_bytes"] - one["peak_inference_bytes"] == size * (root + block), flag
        assert fsdp["peak_train_bytes"] > one["peak_train_bytes"], flag  # gathered copies on top, also in training


@pytest.mark.parametrize("model, mesh", [("gpt2", "fsdp=1"), ("gpt2", "tp=1"), ("llama", "tp=1")])
def test_gpu_prediction_under_a_mesh(runs, model, mesh):
    """--gpu h100 reaches the mesh path's roofline: with no engine applied the step is one device's.
    A rank's step calls loss.backward() (FSDP2 reduce-scatters into .grad) where one device takes
    torch.autograd.grad, so AccumulateGrad adds one aten.detach per parameter: a view, which
    launches no kernel on a GPU and so adds no time. The predicted step is one device's."""
    one = totals(runs, *command(model, "gpu-h100", None))
    ranked = totals(runs, *command(model, "gpu-h100", mesh))
    assert ranked["predicted_step_ms"] == pytest.approx(one["predicted_step_ms"], rel=1e-12)


@pytest.mark.parametrize("mesh", ("fsdp=1", "tp=1"))
def test_compiled_gpu_prediction_under_a_mesh(runs, mesh):
    """--compile-blocks with --gpu h100: the mesh's critical path takes the fused kernels' times as
    one device's prediction does (fxacct.predict.fused_time), so GPT-2's rank step (no engine at
    size 1) is one device's compiled step, faster than its eager one. Timed op by op, the compiled
    graphs (inductor's decompositions, more and smaller ops) came out slower than eager: 6,293
    against 7,925 tokens/s on bench/published.py's Llama 3 8B row, published 6,667 and 5,762."""
    gpu = ("--gpu", "h100", "--compile-blocks", "h.*")
    one = totals(runs, *GPT_ARGS, *gpu)
    ranked = totals(runs, *GPT_ARGS, *gpu, "--mesh", mesh)
    assert ranked["predicted_step_ms"] == pytest.approx(one["predicted_step_ms"], rel=1e-12)
    assert one["predicted_step_ms"] < totals(runs, *command("gpt2", "gpu-h100", None))["predicted_step_ms"]


def test_mixed_precision_policy_mfu(runs):
    """MFU under FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), no --amp: the
    parameters are fp32, but the gathered ones (and so every matmul) are bf16, so mesh.time.mfu
    divides by the H100's bf16 dense peak (989.5 TFLOP/s, NVIDIA's datasheet), not its fp32 one.
    The same model without the policy divides by the fp32 peak."""
    h100 = get_device("h100")
    for parallelize, dtype in (("tests/models/llama_mixed_precision.py:parallelize", "bfloat16"),
                               ("examples/llama.py:parallelize", "float32")):
        result = runs(*LLAMA_ARGS, "--gpu", "h100", "--mesh", "fsdp=2,tp=2", "--parallelize", parallelize)
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        # the traced graph's matmuls: every aten.mm node's output in the expected dtype
        mm = {n["dtype"] for n in doc["nodes"] if n["op"] == "aten.mm.default"}
        assert mm == {dtype}, mm
        t, time = doc["totals"], doc["mesh"]["time"]
        model_flops = sum(t[f"{phase}_flops_by_class"][c] for phase in ("forward", "backward")
                          for c in ("matmul", "attention"))
        step_s = time["step_ms"] / 1e3
        assert time["mfu"] == pytest.approx(model_flops / step_s / h100.peak_flops[dtype], rel=1e-12)
        assert 0 < time["mfu"] < 1
        # tp=2: the group of two GPUs runs the rank's batch (2 × 64 tokens) together
        tp, tokens = 2, 2 * 64
        assert time["tokens_per_s_gpu"] * tp == time["tokens_per_s_tp_group"]
        assert time["tokens_per_s_tp_group"] == pytest.approx(tokens / step_s, rel=1e-12)
        assert time["tokens_per_s_job"] == pytest.approx(time["tokens_per_s_tp_group"] * 4 / tp, rel=1e-12)
    assert h100.peak_flops["bfloat16"] == 989.5e12
