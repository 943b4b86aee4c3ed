"""--loss (issue 11, item 3): cross-entropy, mse and the model's own loss, held against eager runs.

Oracles, independent of fxacct's capture, liveness and cost code:
- the training peak: fxacct.runtime.storage_tracker on a real eager CPU step whose loss is written
  here with torch.nn.functional (the targets made before the step and tracked like the inputs, as a
  data loader makes them);
- the loss's FLOPs: the aten ops an eager F.cross_entropy forward + backward runs (recorded by a
  dispatch mode on real tensors) and the documented per-op constants of docs/conventions.md
  (fxacct/costs/pointwise.py), added up by hand;
- the model's own loss: Hugging Face computes it from ``labels``; its FLOPs and peak must equal the
  same cross-entropy taken by fxacct (HF's ForCausalLMLoss is F.cross_entropy over fp32 logits with
  next-token labels padded by -100), and the peak equals the storage tracker on the eager model.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from helpers import eager_step_peak, flop_counter_oracle, model_flops, target
from torch.utils._python_dispatch import TorchDispatchMode

import fxacct
from fxacct.errors import UsageError
from fxacct.load import model_spec as loading
from fxacct.runtime.storage_tracker import measure_training_step

# A GPT-2 (examples/gpt2.py) whose vocabulary dominates: the logits' fp32 log-softmax and its
# gradient, 4·64·2048·4 B = 2 MiB each, are where the training step peaks.
GPT = ("examples/gpt2.py:GPT", dict(n_layer=2, n_head=4, n_embd=64, vocab_size=2048, block_size=64))
BATCH = 4
TOLERANCE = 0.05  # tests/test_memory_acceptance.py's peak tolerance (these cases come out exact)
aten = torch.ops.aten


def _gpt_config(loss: str, **kw) -> fxacct.Config:
    rel, kwargs = GPT
    return fxacct.Config(target=target(rel), batch=BATCH, kwargs=dict(kwargs), loss=loss, **kw)


def _real_gpt():
    rel, kwargs = GPT
    obj, file_module = loading.resolve(target(rel))
    torch.manual_seed(0)
    model = obj(**kwargs)
    (idx,) = loading.example_inputs(model, file_module, BATCH, device="cpu")[0]
    return model, idx


def _ce(out, y):
    return F.cross_entropy(out.float().view(-1, out.shape[-1]), y.view(-1))


def _mse(out, y):
    return F.mse_loss(out.float(), y.float())


@pytest.mark.slow  # real steps; test_mse_peak_equals_eager_f_mse_loss stays fast
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cross_entropy_peak_equals_eager_f_cross_entropy(optimizer):
    p = fxacct.profile(_gpt_config("cross-entropy", optimizer=optimizer))
    model, idx = _real_gpt()
    y = torch.randint(0, GPT[1]["vocab_size"], idx.shape)
    factory = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    eager = eager_step_peak(model, (idx,), _ce, y, factory)
    assert abs(p.memory.peak_train.bytes / eager - 1) <= TOLERANCE, (p.memory.peak_train.bytes, eager)
    assert p.memory.peak_train.bytes == eager  # exact today
    assert p.memory.peak_train.phase in ("loss", "backward")  # the logits' log-softmax and gradient
    # the targets are an input of the step: 4·64 int64 = 2,048 B beside the 4·64 int64 token ids
    assert p.memory.peak_train.category("inputs") == 2 * BATCH * 64 * 8


def test_cross_entropy_flops_equal_the_eager_ops_by_hand():
    p = fxacct.profile(_gpt_config("cross-entropy"))
    model, idx = _real_gpt()
    with torch.no_grad():
        logits = model(idx).requires_grad_()
    y = torch.randint(0, GPT[1]["vocab_size"], idx.shape)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[func] += 1
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        _ce(logits, y).backward()
    n, v = BATCH * 64, GPT[1]["vocab_size"]
    assert ops.seen[aten._log_softmax.default] == ops.seen[aten._log_softmax_backward_data.default] == 1
    assert ops.seen[aten.nll_loss_forward.default] == ops.seen[aten.nll_loss_backward.default] == 1
    # the element passes of torch's own decompositions (tests/test_formulas.py derives each):
    #   _log_softmax: x - max (n·v), exp (n·v), sum (n·v), log of the n row sums (n), x - m - log (2·n·v)
    #     = 5·n·v + n;  its backward: exp, sum, mul, sub = 4·n·v
    #   nll_loss_forward, mean over n targets: 2 per target, the reduction n, the mean's division 1
    #   nll_loss_backward, mean: 1 per target, 1 per input element (n·v), the mean's division 1
    by_hand = (5 * n * v + n) + 4 * n * v + (3 * n + 1) + (n + n * v + 1)
    assert by_hand == 5_244_162
    assert p.accounting.totals.loss_flops == by_hand
    # the sum loss of the same model: one sum over the logits, 1 per element (docs/conventions.md)
    assert fxacct.profile(_gpt_config("sum")).accounting.totals.loss_flops == n * v


def test_cross_entropy_leaves_forward_and_backward_flops_as_flop_counter_counts_them():
    from fxacct.load.source import load_model

    cfg = _gpt_config("cross-entropy")
    model, args, kwargs, _ = load_model(cfg)
    p = fxacct.profile_module(model, args, kwargs, cfg)
    assert (model_flops(p.accounting.totals.forward), model_flops(p.accounting.totals.backward)) == \
        flop_counter_oracle(model, args, kwargs)


def test_sum_peak_equals_eager_sum():
    """The default loss (a sum) needs nothing of the output in its backward: eager frees the
    [4, 64, 2048] fp32 logits (2 MiB) once the loss is made, before the backward. The trace must
    too (a list of the output's tensors kept to the step's end once held them through it)."""
    p = fxacct.profile(_gpt_config("sum", optimizer="sgd"))
    model, idx = _real_gpt()
    eager = eager_step_peak(model, (idx,), lambda out, _: out.float().sum(), None, torch.optim.SGD)
    assert p.memory.peak_train.bytes == eager


def test_mse_peak_equals_eager_f_mse_loss():
    p = fxacct.profile(_gpt_config("mse", optimizer="sgd"))
    model, idx = _real_gpt()
    y = torch.randn(BATCH, 64, GPT[1]["vocab_size"])  # like the output: float32[4, 64, 2048]
    eager = eager_step_peak(model, (idx,), _mse, y, torch.optim.SGD)
    assert p.memory.peak_train.bytes == eager
    # mse: 3 per element forward (sub, square, sum), 3 per element backward (docs/conventions.md)
    assert p.accounting.totals.loss_flops == 6 * BATCH * 64 * 2048


# --------------------------------------------------------------------------------------------------
# The model's own loss
# --------------------------------------------------------------------------------------------------

HF_GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=2, n_head=4, n_embd=64,
               vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)


@pytest.fixture
def hf_gpt2(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_GPT2))
    return path


@pytest.mark.slow  # a Hugging Face model
def test_hf_model_with_labels_returns_its_own_loss(hf_gpt2):
    from transformers import CONFIG_MAPPING, GPT2LMHeadModel

    own = fxacct.profile(fxacct.Config(target=f"hf:{hf_gpt2}", batch=2, seq_len=32, loss="model"))
    assert own.accounting.input_shapes == ("int64[2,32]", "int64[2,32]")  # input_ids and labels
    assert own.accounting.totals.loss_flops == 0  # the loss ran inside the forward
    # eager: the same model, its loss from labels (HF shifts them), under the storage tracker
    config = CONFIG_MAPPING["gpt2"].from_dict(HF_GPT2)
    config.use_cache = False
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids, labels = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    eager = measure_training_step(model, (), torch.optim.AdamW, loss_fn=lambda o: o.loss,
                                  kwargs=dict(input_ids=ids, labels=labels))
    assert eager.adopted_bytes == 0
    assert own.memory.peak_train.bytes == eager.peak_bytes
    # fxacct's cross-entropy on a causal LM is HF's loss (next-token targets): same FLOPs in all,
    # split differently (HF's loss is in its forward), and the same peak
    ce = fxacct.profile(fxacct.Config(target=f"hf:{hf_gpt2}", batch=2, seq_len=32, loss="cross-entropy"))
    total = lambda t: t.forward.total + t.backward.total + t.loss_flops  # noqa: E731
    assert total(ce.accounting.totals) == total(own.accounting.totals)
    assert ce.accounting.totals.loss_flops > 0
    assert ce.memory.peak_train.bytes == eager.peak_bytes


def test_a_returned_loss_under_sum_is_warned_about(hf_gpt2):
    from fxacct.load.inputs import parse_input_spec

    inputs = tuple(parse_input_spec(f"{n}=long[B,16]<512") for n in ("input_ids", "labels"))
    p = fxacct.profile(fxacct.Config(target=f"hf:{hf_gpt2}", batch=2, inputs=inputs))
    assert any("--loss model" in w for w in p.warnings), p.warnings
    p = fxacct.profile(fxacct.Config(target=f"hf:{hf_gpt2}", batch=2, inputs=inputs, loss="model"))
    assert not any("--loss model" in w for w in p.warnings), p.warnings


def test_hf_model_loss_flops_match_flop_counter(hf_gpt2):
    from fxacct.load.source import load_model

    cfg = fxacct.Config(target=f"hf:{hf_gpt2}", batch=2, seq_len=16, loss="model")
    model, args, kwargs, _ = load_model(cfg)
    assert set(kwargs) == {"input_ids", "labels"}
    p = fxacct.profile_module(model, args, kwargs, cfg)
    fwd, bwd = flop_counter_oracle(model, args, kwargs, output=lambda o: o.loss)
    assert (model_flops(p.accounting.totals.forward), model_flops(p.accounting.totals.backward)) == (fwd, bwd)


class _NanoStyle(torch.nn.Module):
    """nanoGPT's interface: forward(idx, targets) -> (logits, loss)."""

    def __init__(self, vocab=32, d=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        logits = self.head(self.emb(idx))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss


def test_nanogpt_style_forward_with_targets_uses_its_loss():
    with torch.device("meta"):
        model = _NanoStyle()
    idx = torch.empty(2, 4, dtype=torch.long, device="meta")
    own = fxacct.profile_module(model, (idx, idx), {}, fxacct.Config(batch=2, loss="model"))
    ce = fxacct.profile_module(model, (idx,), {}, fxacct.Config(batch=2, loss="cross-entropy"))
    t_own, t_ce = own.accounting.totals, ce.accounting.totals
    assert t_own.loss_flops == 0
    # the same cross-entropy (fxacct's upcast .float() is free on fp32 logits), inside the forward
    assert t_own.forward.total + t_own.backward.total == t_ce.forward.total + t_ce.backward.total + t_ce.loss_flops
    with pytest.raises(UsageError, match="no 'loss'"):
        fxacct.profile_module(model, (idx,), {}, fxacct.Config(batch=2, loss="model"))


def test_unknown_loss_is_a_usage_error():
    with pytest.raises(UsageError, match="cross-entropy"):
        fxacct.Config(loss="hinge")


def test_what_the_loss_saves_is_in_the_total_and_the_root_row_only():
    """Cross-entropy saves the fp32 log-softmax of the logits (4·64·2048·4 B = 2 MiB), the int64
    targets (4·64·8 B = 2,048 B) and nll_loss's total_weight (a float32 scalar, 4 B) for its
    backward; the loss belongs to no module, so the node rows
    do not hold it and the root row does: nodes + loss = total = root row. The sum loss saves
    nothing (its gradient is ones)."""
    p = fxacct.profile(_gpt_config("cross-entropy"))
    t = p.accounting.totals
    n, v = BATCH * 64, GPT[1]["vocab_size"]
    assert t.loss_activation_bytes == n * v * 4 + n * 8 + 4
    assert sum(r.activation_bytes for r in p.accounting.nodes) + t.loss_activation_bytes == t.activation_bytes
    root = next(m for m in p.accounting.modules if m.module == "")
    assert root.activation_bytes == t.activation_bytes
    plain = fxacct.profile(_gpt_config("sum")).accounting.totals
    assert plain.loss_activation_bytes == 0
    assert plain.activation_bytes == t.activation_bytes - t.loss_activation_bytes


def _cross_entropy_flops(rows: int, classes: int) -> int:
    """F.cross_entropy's loss FLOPs by hand, mean over ``rows`` targets of ``classes`` classes (the
    element passes of test_cross_entropy_flops_equal_the_eager_ops_by_hand): log-softmax 5·n·v + n,
    its backward 4·n·v, nll_loss forward 3·n + 1, its backward n + n·v + 1."""
    n, v = rows, classes
    return (5 * n * v + n) + 4 * n * v + (3 * n + 1) + (n + n * v + 1)


def _eager_ce_ops(logits, y, flatten: bool) -> Counter:
    """The aten ops (with their input shapes) an eager F.cross_entropy forward + backward runs."""
    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[func, tuple(args[0].shape)] += 1
            return func(*args, **(kwargs or {}))

    logits = logits.detach().requires_grad_()
    with Ops() as ops:
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)) if flatten else F.cross_entropy(logits, y)
        loss.backward()
    return ops.seen


def _cli_json(*args) -> dict:
    from click.testing import CliRunner

    from fxacct_cli.main import cli

    r = CliRunner().invoke(cli, ["profile", *args, "--format", "json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_cross_entropy_on_image_logits_takes_dim_1_as_the_classes():
    # [B, 5, 32, 32]: F.cross_entropy reads 5 classes at each of B·32·32 pixels, not 32 classes
    b = 2
    eager = _eager_ce_ops(torch.randn(b, 5, 32, 32), torch.randint(0, 5, (b, 32, 32)), flatten=False)
    assert eager[aten.nll_loss2d_forward.default, (b, 5, 32, 32)] == 1  # the classes stay in dim 1
    doc = _cli_json("tests/models/segmenter.py:Segmenter", "--batch", str(b), "--loss", "cross-entropy")
    assert doc["totals"]["loss_flops"] == _cross_entropy_flops(b * 32 * 32, 5) == 112_642
    # the target is an input of the step: int64[2, 32, 32] = 16,384 B beside the 2·3·32·32·4 B images
    p = fxacct.profile(fxacct.Config(target="tests/models/segmenter.py:Segmenter", batch=b, loss="cross-entropy"))
    assert p.memory.peak_train.category("inputs") == b * 32 * 32 * 8 + b * 3 * 32 * 32 * 4


def test_cross_entropy_on_language_model_logits_takes_the_vocabulary():
    # [B, T, V] logits of a tiny GPT (T = 16, V = 64): B·T rows of V classes, flattened as nanoGPT does
    b, t, v = 2, 16, 64
    eager = _eager_ce_ops(torch.randn(b, t, v), torch.randint(0, v, (b, t)), flatten=True)
    assert eager[aten._log_softmax.default, (b * t, v)] == 1
    doc = _cli_json("examples/gpt2.py:GPT", "-k", "n_layer=1", "-k", "n_embd=32", "-k", "n_head=2",
                    "-k", f"block_size={t}", "-k", f"vocab_size={v}", "--batch", str(b), "--loss", "cross-entropy")
    assert doc["totals"]["loss_flops"] == _cross_entropy_flops(b * t, v) == 20_642


def test_help_says_why_sum_is_the_default_and_when_to_give_cross_entropy():
    from click.testing import CliRunner

    from fxacct_cli.main import cli

    text = " ".join(CliRunner().invoke(cli, ["profile", "--help"], terminal_width=200).output.split())
    assert "[default: sum]" in text
    assert "the model's FLOPs are the same under every loss" in text
    assert "Give cross-entropy for a language model" in text
