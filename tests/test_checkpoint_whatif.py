"""--checkpoint PATTERN: the modules that match run under non-reentrant activation checkpointing
during capture. Oracles: the same GPT wrapped by hand with torch.utils.checkpoint, run eagerly
(saved_tensors_hooks for activation bytes, the storage tracker for the peak), and FlopCounterMode on
meta for what the backward re-runs."""

import pytest
import torch
from helpers import SMALL_EXAMPLES, config, eager_saved_bytes, floating_loss, load, real_model
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import fxacct
from fxacct.errors import UsageError
from fxacct.runtime.storage_tracker import measure_training_step

GPT = SMALL_EXAMPLES["GPT"]  # n_layer=2, n_head=4, n_embd=64, vocab 100, block_size 32
B = 2


def wrap_blocks_by_hand(model):
    for block in model.h:
        block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
    return model


def recomputed(p: fxacct.Profile) -> int:
    """matmul + attention FLOPs of the backward ops fxacct marked as re-run forward ops."""
    total = 0
    for node in p.capture.graph.nodes:
        cost = node.meta.get("fxacct")
        if cost is not None and cost.recompute:
            total += cost.flops.matmul + cost.flops.attention
    return total


def backward_flops_on_meta(model, args) -> int:
    with FakeTensorMode(allow_non_fake_inputs=True):
        loss = floating_loss(model(*args))
        with FlopCounterMode(display=False) as fc:
            loss.backward()
    return fc.get_total_flops()


@pytest.fixture(scope="module")
def profiled():
    return fxacct.profile(config("GPT", batch=B, checkpoint=("h.*",)))


def test_activation_bytes_equal_eager_with_checkpointed_blocks(profiled):
    model, args, kw = real_model(GPT[0], GPT[1], B)
    total, _ = eager_saved_bytes(wrap_blocks_by_hand(model), args, kw)
    w = profiled.checkpoint
    assert w.modules == ("h.0", "h.1")  # outermost matches only: not h.0.attn, h.0.mlp.c_fc, ...
    assert w.checkpointed.activation_bytes == profiled.accounting.totals.activation_bytes == total
    plain, _ = eager_saved_bytes(real_model(GPT[0], GPT[1], B)[0], args, kw)
    assert w.eager.activation_bytes == plain > total


def test_training_peak_matches_the_storage_tracker(profiled):
    model, args, kw = real_model(GPT[0], GPT[1], B)
    step = measure_training_step(wrap_blocks_by_hand(model), args, torch.optim.AdamW, kwargs=kw)
    assert step.adopted_bytes == 0
    assert abs(profiled.checkpoint.checkpointed.peak_train_bytes / step.peak_bytes - 1) <= 0.01


def test_recompute_flops_equal_the_blocks_forward_as_rerun(profiled):
    model, args, _ = load(config("GPT", batch=B))
    plain = backward_flops_on_meta(model, args)
    model, args, _ = load(config("GPT", batch=B))
    rerun = backward_flops_on_meta(wrap_blocks_by_hand(model), args) - plain
    # Closed form (B=2, T=32, C=64, 2 blocks): a block's forward is c_attn 2·64·64·192 = 1,572,864,
    # attention 2·2·2·4·32·32·16 = 524,288, attn c_proj 524,288, c_fc 2,097,152, mlp c_proj 2,097,152
    # = 6,815,744. Non-reentrant checkpointing stops re-running once the last tensor the backward
    # needs exists (torch.utils.checkpoint's early stop): the mlp's c_proj output is saved by no one,
    # so it is not re-run: 2 · (6,815,744 - 2,097,152) = 9,437,184.
    assert rerun == 9_437_184
    assert recomputed(profiled) == rerun
    assert profiled.checkpoint.eager.recompute_flops == 0
    assert profiled.checkpoint.checkpointed.recompute_flops >= rerun  # plus their elementwise ops
    # model FLOPs leave the re-run ops out: the backward is the plain model's
    base = fxacct.profile(config("GPT", batch=B)).accounting.totals
    assert profiled.accounting.totals.backward == base.backward


def test_save_matmuls_recomputes_no_product():
    p = fxacct.profile(config("GPT", batch=B, checkpoint=("h.*",), checkpoint_policy="save-matmuls"))
    products = sum(n.meta["fxacct"].flops.matmul for n in p.capture.graph.nodes
                   if n.meta.get("fxacct") is not None and n.meta["fxacct"].recompute)
    assert products == 0
    assert 0 < p.checkpoint.checkpointed.recompute_flops < 9_437_184


def test_a_pattern_matching_nothing_is_a_usage_error():
    with pytest.raises(UsageError, match="matches no module"):
        fxacct.profile(config("GPT", batch=B, checkpoint=("blocks.*",)))
    with torch.device("meta"):  # no submodule at all: said so (it listed 'module names look like: ' and none)
        linear = torch.nn.Linear(4, 4)
    with pytest.raises(UsageError, match=r"^--checkpoint '\*': the model has no submodule to checkpoint; drop --checkpoint$"):
        fxacct.profile_module(linear, (torch.empty(2, 4, device="meta"),), config=fxacct.Config(batch=2, checkpoint="*"))
    with pytest.raises(UsageError, match="--checkpoint-policy needs --checkpoint"):
        config("GPT", batch=B, checkpoint_policy="save-matmuls")
    with pytest.raises(UsageError, match="--checkpoint-policy"):
        fxacct.profile(config("GPT", batch=B, checkpoint=("h.*",), checkpoint_policy="keep-all"))


def test_the_model_is_left_as_it_was(profiled):
    model, args, _ = load(config("GPT", batch=B))
    fxacct.profile_module(model, args, {}, fxacct.Config(batch=B, checkpoint=("h.*",)))
    assert all("forward" not in block.__dict__ for block in model.h)


def test_cli_reports_both_accounts(tmp_path):
    import json

    from click.testing import CliRunner
    from helpers import target

    from fxacct_cli.main import cli as main

    rel, kwargs = GPT
    args = ["profile", target(rel), "--batch", str(B), "--checkpoint", "h.*"]
    args += [f"-k{k}={v}" for k, v in kwargs.items()]
    text = CliRunner().invoke(main, args)
    assert text.exit_code == 0, text.output
    assert "activation checkpointing what-if (h.*: 2 modules wrapped)" in text.output
    out = CliRunner().invoke(main, [*args, "--format", "json"])
    doc = json.loads(out.output)["checkpoint"]
    assert doc["modules"] == ["h.0", "h.1"]
    assert doc["with"]["activation_bytes"] < doc["without"]["activation_bytes"]
    assert doc["without"]["recompute_flops"] == 0 < doc["with"]["recompute_flops"]
    # the change column in its row's unit (binary bytes beside the MiB/KiB columns, SI FLOPs), signed
    from fxacct.units import format_bytes, format_count

    section = text.output.split("activation checkpointing what-if")[1]
    saved = next(line for line in section.splitlines() if line.startswith("activations (saved)"))
    fewer = doc["without"]["activation_bytes"] - doc["with"]["activation_bytes"]
    assert saved.endswith(f"  -{format_bytes(fewer)}") and format_bytes(fewer).endswith("iB"), saved
    recompute = next(line for line in section.splitlines() if line.startswith("recompute FLOPs"))
    assert recompute.endswith(f"  +{format_count(doc['with']['recompute_flops'])}"), recompute
    bad = CliRunner().invoke(main, [*args[:-2], "--checkpoint", "nothing.*"])
    assert bad.exit_code == 2 and "matches no module" in bad.output


@pytest.mark.slow  # two largest-batch searches; test_memory_cli keeps the fit search fast
def test_gpu_largest_batch_each_way():
    # --gpu runs the recompute under the CUDA kernel rules too (the backward engine drops
    # TorchFunctionModes; fxacct.trace.checkpointing re-enters them)
    p = fxacct.profile(config("GPT", batch=B, checkpoint=("h.*",), gpu="h100"))
    w = p.checkpoint
    assert w.eager.max_batch is not None and w.checkpointed.max_batch > w.eager.max_batch
    assert p.memory.fit.max_batch == w.checkpointed.max_batch


def test_deeper_model_same_account_with_and_without_dedup():
    # 4 blocks: enough for block replay, which a checkpointed training trace does without
    # (fxacct.trace.capture._replay_for); the inference trace and the plain trace still replay
    cfg = dict(n_layer=4, n_head=4, n_embd=64, vocab_size=100, block_size=32)
    a, b = (fxacct.profile(fxacct.Config(target=target_gpt(), batch=B, kwargs=cfg, checkpoint=("h.*",),
                                         dedup=dedup)) for dedup in (True, False))
    assert a.checkpoint == b.checkpoint
    assert a.accounting.totals == b.accounting.totals
    assert a.checkpoint.checkpointed.recompute_flops > 0


def target_gpt():
    from helpers import target

    return target(GPT[0])


def test_real_runs_checkpoint_the_same_modules():
    from fxacct.runtime.build import build_model

    model, _ = build_model(config("GPT", batch=B, checkpoint=("h.*",)), torch.device("cpu"))
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == ["h.0", "h.1"]
    _, args, kw = real_model(GPT[0], GPT[1], B)
    saved, _ = eager_saved_bytes(model, args, kw)
    hand, _ = eager_saved_bytes(wrap_blocks_by_hand(real_model(GPT[0], GPT[1], B)[0]), args, kw)
    assert saved == hand


LLAMA = ("examples/llama.py:Llama", {})  # dim 64, 4 heads, 2 kv heads (kv dim 32), hidden 128, T 64, 2 blocks
SAC = "examples/llama.py:torchtitan_sac"


def test_a_policy_factory_gives_each_block_call_its_own_policy():
    # torchtitan's per-op SAC saves every other matmul of a block call, its count starting afresh in
    # each block: of a block's 7 mms (wq, wk, wv, wo, w1, w3, w2) the odd-numbered are saved and wk,
    # wo, w3 recomputed (each needed by the backward: k by the recomputed attention, wo's output
    # by ffn_norm's input, w3's by w2's input). B=2, T=64: 128 tokens; wk 2·128·64·32 = 524,288,
    # wo 2·128·64·64 = 1,048,576, w3 2·128·64·128 = 2,097,152: 3,670,016 per block, 7,340,032 for
    # two. One counter across the blocks would recompute wq, wv and w1 in the second block instead.
    p = fxacct.profile(fxacct.Config(target=LLAMA[0], batch=B, checkpoint=("layers.*",), checkpoint_policy=SAC))
    products = sum(n.meta["fxacct"].flops.matmul for n in p.capture.graph.nodes
                   if n.meta.get("fxacct") is not None and n.meta["fxacct"].recompute)
    assert products == 2 * (524_288 + 1_048_576 + 2_097_152)


def test_torchtitan_sac_peak_matches_the_storage_tracker():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from examples.llama import torchtitan_sac

    p = fxacct.profile(fxacct.Config(target=LLAMA[0], batch=B, checkpoint=("layers.*",), checkpoint_policy=SAC))
    model, args, kw = real_model(LLAMA[0], LLAMA[1], B)
    for block in model.layers.values():
        block.forward = (lambda f: lambda *a: checkpoint(
            f, *a, use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(torchtitan_sac())))(block.forward)
    step = measure_training_step(model, args, torch.optim.AdamW, kwargs=kw)
    assert step.adopted_bytes == 0
    assert abs(p.checkpoint.checkpointed.peak_train_bytes / step.peak_bytes - 1) <= 0.01
