"""--mesh on Hugging Face models without --parallelize: transformers' own engine applies the plan
the model carries (fxacct.parallel.plans), whatever its styles, and fxacct's FSDP2 goes on fsdp.
Oracles (tests/parallel_oracle.py): the same models parallelized by the same function, run
eagerly on real CPU tensors under the fake process group; collectives counted by a dispatch
counter (exact counts and bytes), the per-rank peak by the storage tracker (within 2%)."""

from __future__ import annotations

import pytest
import torch
from helpers import target
from parallel_oracle import eager_collectives, eager_peak, fxacct_collectives, load, predicted_by_op

import fxacct
from fxacct.report import document

pytest.importorskip("transformers.distributed.tensor_parallel")
pytestmark = pytest.mark.slow  # Hugging Face models under transformers' plans, checked against eager and gloo runs

MODELS = {  # name: (target, dtype); Mixtral's default grouped_mm experts take bf16 only
    "llama": ("tests/models/hf_llama_tp.py:make", None),
    "qwen3": ("tests/models/hf_tp_models.py:qwen3", None),
    "mixtral": ("tests/models/hf_tp_models.py:mixtral", torch.bfloat16),
    "mixtral_batched_mm": ("tests/models/hf_tp_models.py:mixtral_batched_mm", None),
    "gemma2": ("tests/models/hf_tp_models.py:gemma2", None),
}
MESHES = ({"tp": 2}, {"fsdp": 2, "tp": 2})
BATCH = 2


def _config(name, dims, **kw):
    rel, dtype = MODELS[name]
    mesh = ",".join(f"{k}={v}" for k, v in dims.items()) if dims else None
    return fxacct.Config(target=target(rel), batch=BATCH, mesh=mesh, dtype=dtype, **kw)


def _eager_args(name, dims, cfg):
    """(model_fn, parallelize, inputs) for the oracle: fxacct's own parallelize (transformers'
    plan on tp, FSDP2 on fsdp), called on a real model."""
    from fxacct.parallel.engine import parallelize

    rel, dtype = MODELS[name]
    make, inputs = load(rel), load(rel.rpartition(":")[0] + ":example_inputs")

    def model_fn():
        return make() if dtype is None else make().to(dtype)

    torch.manual_seed(0)
    return model_fn, lambda m, mesh: parallelize(m, cfg.mesh, mesh, cfg), inputs(BATCH)


@pytest.mark.parametrize("dims", MESHES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_plan_collectives_and_peak_equal_the_eager_run(name, dims):
    cfg = _config(name, dims)
    p = fxacct.profile(cfg)
    got_count, got_bytes = fxacct_collectives(document(p))
    model_fn, par, inputs = _eager_args(name, dims, cfg)
    count, nbytes, _ = eager_collectives(model_fn, par, dims, inputs)
    assert (got_count, got_bytes) == (count, nbytes)
    predicted = p.memory.peak_train.bytes
    measured = eager_peak(model_fn, par, dims, inputs)
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_qwen3_and_mixtral_all_reduces_in_closed_form():
    """tp=2, B=2, T=16, H=64 (N = 32 tokens): one activation all-reduce moves N·H elements.
    Qwen3 (fp32, 8192 B each): per block 2 forward (o_proj, down_proj) + 5 backward (the input
    gradients of q, k, v, gate, up), plus the embedding's forward and lm_head's input gradient:
    2·7 + 2 = 16 of 8192 B; and the q_norm / k_norm weight gradients (head_dim 16, 64 B each),
    2 per block: 20 all-reduces, 16·8192 + 4·64 = 131,328 B.
    Mixtral (bf16, 4096 B each): per block o_proj and the experts' summed output forward, the
    q, k, v input gradients and the experts' input gradient backward (6), plus embedding and
    lm_head: 14 of 4096 B; and the routing weights' gradient (N·k = 64 fp32 values, 256 B) per
    block: 16 all-reduces, 14·4096 + 2·256 = 57,856 B. lm_head (colwise_gather_output) gathers
    its output once: the full N·V logits, 32·256·4 B = 32,768 B (bf16: 16,384)."""
    for name, n, nbytes, gathered in (("qwen3", 20, 131_328, 32_768), ("mixtral", 16, 57_856, 16_384)):
        count, by = fxacct_collectives(document(fxacct.profile(_config(name, {"tp": 2}))))
        assert (count["all_reduce"], by["all_reduce"]) == (n, nbytes), name
        assert (count["all_gather"], by["all_gather"]) == (1, gathered), name


def _matmul_flops_by_module(name, dims):
    """matmul FLOPs summed per module pattern (layer numbers dropped)."""
    from collections import Counter

    by: Counter = Counter()
    for node in fxacct.profile(_config(name, dims)).capture.graph.nodes:
        cost = node.meta.get("fxacct")
        if cost is not None and cost.flops.matmul:
            by[".".join(x for x in cost.module.split(".") if not x.isdigit())] += cost.flops.matmul
    return by


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_tp2_halves_the_matmuls_of_the_sharded_layers(name):
    """A linear in→out on N = B·T = 32 tokens costs 2·N·in·out forward and twice that backward
    (input and weight gradients): 6·N·in·out per step, over 2 blocks; tp=2 gives each rank half
    of every sharded layer's columns or rows, so half of it. H=64, 4 heads and 2 kv heads of 16:
    q, o 64·64; k, v 64·32; Qwen3's gate, up, down 64·96; lm_head 64·256. Mixtral's experts: the
    N·k = 64 routed rows through gate_up (64→2·32) and down (32→64), 6·64·(64·64 + 32·64) per block.
    Its router (mlp.gate, 64→4 experts) is not in the plan: replicated, whole on every rank."""
    n, blocks = 32, 2
    layers = {"model.layers.self_attn.q_proj": 64 * 64, "model.layers.self_attn.k_proj": 64 * 32,
              "model.layers.self_attn.v_proj": 64 * 32, "model.layers.self_attn.o_proj": 64 * 64}
    if name == "qwen3":
        layers |= {f"model.layers.mlp.{p}": 64 * 96 for p in ("gate_proj", "up_proj", "down_proj")}
    single = {k: 6 * n * v * blocks for k, v in layers.items()} | {"lm_head": 6 * n * 64 * 256}
    if name == "mixtral":
        single["model.layers.mlp.experts"] = 6 * 64 * (64 * 64 + 32 * 64) * blocks
    one, ranked = _matmul_flops_by_module(name, {}), _matmul_flops_by_module(name, {"tp": 2})
    assert {k: one[k] for k in single} == single
    assert {k: ranked[k] for k in single} == {k: v // 2 for k, v in single.items()}
    if name == "mixtral":
        assert ranked["model.layers.mlp.gate"] == one["model.layers.mlp.gate"] == 6 * n * 64 * 4 * blocks


def test_without_transformers_engine_fxacct_maps_the_plan_or_says_which_style(monkeypatch):
    """An installed transformers without its own TP engine: fxacct's mapping, and a one-line
    usage error (exit 2) for a style it does not map (Qwen3's per-head norms); Llama's plan maps,
    and its collectives are the eager run's under the same mapping."""
    from fxacct.errors import UsageError
    from fxacct.parallel import plans

    monkeypatch.setattr(plans, "transformers_engine", lambda: None)
    with pytest.raises(UsageError, match="'replicated_with_grad_allreduce', which fxacct does not map"):
        fxacct.profile(_config("qwen3", {"tp": 2}))
    cfg = _config("llama", {"tp": 2})
    got = fxacct_collectives(document(fxacct.profile(cfg)))
    model_fn, par, inputs = _eager_args("llama", {"tp": 2}, cfg)
    count, nbytes, _ = eager_collectives(model_fn, par, {"tp": 2}, inputs)
    assert got == (count, nbytes) and count["all_reduce"] > 0


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_real_gloo_run_under_transformers_plan(name):
    """fsdp=2,tp=2 in four CPU processes on gloo (fxacct.runtime.gloo_run): every rank issues the
    collectives the account shows (count and bytes per op) and peaks within 2% of it."""
    from fxacct.runtime.gloo_run import run_mesh

    cfg = _config(name, {"fsdp": 2, "tp": 2})
    p = fxacct.profile(cfg)
    predicted = predicted_by_op(p.parallel.rows)
    ranks = run_mesh(cfg, steps=1, warmup=1)
    assert len(ranks) == 4
    peak = p.memory.peak_train.bytes
    for m in ranks:
        assert m.collectives == predicted, (m.rank, m.collectives, predicted)
        assert abs(m.op_level_peak_bytes - peak) <= 0.02 * peak, (m.rank, m.op_level_peak_bytes, peak)


def test_a_hugging_face_model_without_a_plan_is_a_usage_error(tmp_path):
    """GPT-2 declares no base_model_tp_plan: exit 2, naming the fix."""
    from click.testing import CliRunner
    from transformers import GPT2Config

    from fxacct_cli.main import cli

    GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32).save_pretrained(tmp_path)
    r = CliRunner().invoke(cli, ["profile", f"hf:{tmp_path}", "--batch", "1", "--seq-len", "8", "--mesh", "tp=2"])
    assert r.exit_code == 2, r.output
    assert "GPT2LMHeadModel carries no tensor-parallel plan" in r.output and "--parallelize" in r.output
