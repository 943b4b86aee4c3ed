"""Which backward ops are "recomputed by activation checkpointing": only those torch.utils.checkpoint
re-runs (the model's own non-reentrant calls, or --checkpoint's wrapping). A custom autograd.Function whose
backward re-runs forward ops under enable_grad is doing its own backward work: those ops are backward
FLOPs, never labelled as checkpointing's recompute. Expected FLOPs by hand (1 FMA = 2 FLOPs)."""

import torch
from torch.utils.checkpoint import checkpoint

import fxacct
from fxacct.report.text import render_profile_text

N, D, H = 4, 8, 16
MM = 2 * N * D * H  # x @ w: [4,8] @ [8,16] = 1,024 FLOPs; dX = g @ wᵀ and dW = xᵀ @ g cost the same


class RecomputingGelu(torch.autograd.Function):
    """gelu(x @ w) saving only its inputs: the backward recomputes x @ w and the gelu, then differentiates."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.nn.functional.gelu(x @ w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = torch.nn.functional.gelu(x_ @ w_)
        return torch.autograd.grad(y, (x_, w_), g)


class Model(torch.nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(D, H))
        self.how = how

    @staticmethod
    def body(x, w):
        return torch.nn.functional.gelu(x @ w)

    def forward(self, x):
        if self.how == "function":
            return RecomputingGelu.apply(x, self.w)
        if self.how == "plain":
            return self.body(x, self.w)
        return checkpoint(self.body, x, self.w, use_reentrant=False)


def account(how: str, **config) -> fxacct.Profile:
    with torch.device("meta"):
        model = Model(how)
    return fxacct.profile_module(model, (torch.empty(N, D, device="meta"),), config=fxacct.Config(batch=N, **config))


def test_a_custom_function_recomputing_in_its_backward_is_not_checkpointing():
    p = account("function")
    t = p.accounting.totals
    assert t.recompute_flops == 0
    # its backward runs x @ w again, then dX and dW: three products, all backward work
    assert t.forward.matmul == MM and t.backward.matmul == 3 * MM
    assert "activation checkpointing" not in render_profile_text(p)


def test_torch_utils_checkpoint_is_still_a_recompute():
    p, plain = account("checkpoint"), account("plain")
    t = p.accounting.totals
    # non-reentrant checkpointing stops early, once x @ w (gelu's saved input, the last tensor the
    # backward needs) is recomputed: the gelu is not re-run
    assert t.recompute_flops == MM
    # the backward left is the plain model's: dW only (x needs no gradient) and gelu's backward
    assert t.backward == plain.accounting.totals.backward and t.backward.matmul == MM
    assert "recomputed by activation checkpointing" in render_profile_text(p)


def test_the_summary_says_where_counted_recompute_went():
    """--count-recompute (hardware FLOPs) puts the recompute in the backward: the summary's recompute
    line says so, where by default (model FLOPs) it says it is left out."""
    model_flops, hardware = account("checkpoint"), account("checkpoint", count_recompute=True)
    assert hardware.accounting.totals.backward.matmul == model_flops.accounting.totals.backward.matmul + MM
    text, default = render_profile_text(hardware), render_profile_text(model_flops)
    assert "1.024k FLOPs, in the backward above (hardware FLOPs: --count-recompute)" in text
    assert "not in the backward above" not in text
    assert "1.024k FLOPs, not in the backward above (model FLOPs; --count-recompute adds them)" in default
