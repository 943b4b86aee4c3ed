"""torch.utils.checkpoint written into the model itself (not --checkpoint): the blocks of a
residual stack called through checkpoint from the parent's loop, non-reentrant and reentrant
(Hugging Face's gradient_checkpointing_enable() defaults to reentrant), and blocks that checkpoint
their own inner MLP. The oracle is a real step on the storage tracker; block replay, on by
default, must give it too, as tracing every block does (--no-dedup).

Each failed before: a replayed block's probe ran torch.autograd.grad inside the checkpoint's
frame (CheckpointError, blamed on the model, exit 3); reentrant checkpointing refuses
torch.autograd.grad, which the capture's backward used (exit 3); a block checkpointing inside
was replayed 1.8% under the real step's peak; and a residual's incoming gradient, which the
other branch still holds, was taken dead at its last use inside a replayed block (the plain
stack with --input-requires-grad: 1,540 B under)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import eager_step_peak, real_model, target
from torch.optim import SGD

import fxacct

MODELS = "tests/models/residual_checkpoint.py"
BATCH = 4


@pytest.mark.parametrize("name, input_requires_grad", [
    ("Residual", True), ("CheckpointedCalls", False), ("CheckpointedCalls", True),
    ("ReentrantCalls", True), ("CheckpointInside", False),
])
def test_peak_equals_a_real_step_with_and_without_block_replay(name, input_requires_grad):
    cfg = fxacct.Config(target=target(f"{MODELS}:{name}"), batch=BATCH, optimizer="sgd", loss="sum",
                        input_requires_grad=input_requires_grad)
    replayed = fxacct.profile(cfg).memory.peak_train.bytes
    traced = fxacct.profile(replace(cfg, dedup=False)).memory.peak_train.bytes
    model, args, _ = real_model(f"{MODELS}:{name}", {}, BATCH)
    args = tuple(a.requires_grad_(input_requires_grad) for a in args)
    assert replayed == traced == eager_step_peak(model, args, lambda out, _: out.sum(), optimizer=SGD)


def test_reentrant_checkpointing_recomputes_each_block_forward():
    """Reentrant checkpointing runs each block's whole forward again in the backward: counted as
    recompute, apart from the model's FLOPs, which equal the plain stack's. The recompute is the
    plain stack's forward but its three residual adds (one FLOP per element of [B, 32, 128])."""
    cfg = fxacct.Config(target=target(f"{MODELS}:ReentrantCalls"), batch=BATCH, optimizer="sgd", loss="sum",
                        input_requires_grad=True)
    plain = fxacct.profile(replace(cfg, target=target(f"{MODELS}:Residual"))).accounting.totals
    totals = fxacct.profile(cfg).accounting.totals
    assert totals.model_flops == plain.model_flops
    assert totals.recompute_flops == plain.forward.total - 3 * BATCH * 32 * 128


def test_reentrant_checkpointing_without_an_input_that_requires_grad_says_why_nothing_trains():
    """Eager: torch warns "None of the inputs have requires_grad=True", the blocks' outputs do not
    require grad, and loss.backward() raises. The note said no parameter requires grad, which is
    false here; it now names the cut graph and the two fixes."""
    p = fxacct.profile(fxacct.Config(target=target(f"{MODELS}:ReentrantCalls"), batch=BATCH, optimizer="sgd"))
    assert p.memory.peak_train is None
    (note,) = [n for n in p.warnings if n.startswith("nothing trains")]
    assert "parameters require grad but the loss does not" in note and "--input-requires-grad" in note
    plain = fxacct.profile(fxacct.Config(target=target(f"{MODELS}:Residual"), batch=BATCH, optimizer="sgd"))
    assert plain.memory.peak_train is not None and not any(n.startswith("nothing trains") for n in plain.warnings)


def _timeline(cfg: fxacct.Config) -> list[tuple[str, int]]:
    """(op, live bytes) per op of the training step."""
    from fxacct.memory.peak import lifetimes, walk

    out: list = []
    walk(lifetimes(fxacct.profile(cfg).capture), timeline=out)
    return [(name, sum(live.values())) for name, _, live in out]


@pytest.mark.parametrize("rel, kwargs, input_requires_grad", [
    (f"{MODELS}:Residual", {}, True),
    ("examples/llama.py:Llama", dict(n_layers=3, dim=64, n_heads=4, n_kv_heads=2, hidden=128, vocab_size=100,
                                     max_seq=16), False),
    ("examples/gpt2.py:GPT", dict(n_layer=3, n_head=4, n_embd=64, vocab_size=100, block_size=16), False),
    ("examples/mlp.py:MLP", dict(d_model=32, d_hidden=64, n_blocks=3), True),
])
def test_a_replayed_step_lives_op_for_op_as_the_traced_one(rel, kwargs, input_requires_grad):
    """The memory timeline, not only its peak: a replayed block held its saved inputs to the end
    of its whole backward, where the engine lets them go once the node that saved them has run
    (before it sums that node's gradient into another's): 65,536 B two ops too long per block of
    the residual stack, 16,384 B one op too long per Llama block, 512 B per MLP block (where
    the sum's other gradient is the block's incoming one)."""
    cfg = fxacct.Config(target=target(rel), batch=BATCH, kwargs=kwargs, optimizer="sgd", loss="sum",
                        input_requires_grad=input_requires_grad)
    assert _timeline(cfg) == _timeline(replace(cfg, dedup=False))
