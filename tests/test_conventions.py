"""Conventions that change what counts: activation checkpointing's recompute, and costs of ops the
core examples do not use (embedding bags), checked by hand."""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fxacct
from fxacct.units import format_count


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32, bias=False)
        self.b = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return self.b(checkpoint(lambda t: self.a(t).relu(), x, use_reentrant=False))


def _profile(model, x, **config):
    return fxacct.profile_module(model, (x,), {}, fxacct.Config(batch=x.shape[0], **config)).accounting.totals


def test_recompute_is_reported_apart_by_default():
    with torch.device("meta"):
        model = Checkpointed()
    x = torch.empty(2, 32, device="meta")
    t = _profile(model, x)
    # forward: two (2,32)@(32,32) products, 2·2·32·32 = 4,096 each; backward without recompute:
    # dW_a, dW_b and dX_b (x needs no grad) = 3 × 4,096; the re-run a(x) is 4,096 matmul + 64 relu
    assert t.forward.matmul == 8_192
    assert t.backward.matmul == 12_288
    assert t.recompute_flops == 4_096 + 64
    counted = _profile(model, x, count_recompute=True)
    assert counted.backward.total == t.backward.total + t.recompute_flops
    assert counted.recompute_flops == t.recompute_flops


def test_no_recompute_without_checkpointing():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    assert _profile(model, torch.empty(2, 8, device="meta")).recompute_flops == 0


def test_embedding_bag_costs_one_add_per_gathered_element():
    with torch.device("meta"):
        model = nn.EmbeddingBag(100, 8, mode="sum")
    x = torch.empty(3, 5, dtype=torch.long, device="meta")
    p = fxacct.profile_module(model, (x,), {}, fxacct.Config(batch=3))
    t = p.accounting.totals
    # 3 bags × 5 indices × 8 values added, plus one pass over the (3, 8) output: 120 + 24
    assert t.forward.other == 144
    # backward: each of the 15 indices scatters an 8-wide gradient row: 120
    assert t.backward.other == 120
    assert p.accounting.unsupported_ops == {}


@pytest.mark.parametrize("n, shown", [
    (999, "999"), (1000, "1.000k"), (999_999, "999.999k"), (999_999_600, "1.000G"),
    (999_999_400_000_000, "999.999T"), (999_999_600_000_000, "1.000P"), (-999_999_600_000, "-1.000T"),
    (999.9996, "1.000k"), (12.345, "12.3"), (999.9996e18, "1.000e+21"), (2e21, "2.000e+21"),
])
def test_counts_take_the_unit_their_rounded_value_reads_in(n, shown):
    # 999,999,600,000,000 at three decimals in T is 1000.000T: one unit up, it reads 1.000P
    assert format_count(n) == shown


@pytest.mark.parametrize("over, limit, shown", [
    (1, 17_087, "(0.0059% of the limit)"), (1, 80 * 10**9, "(under 0.001% of the limit)"),
    (171, 17_087, "(1.0% of the limit)"), (0, 17_087, "(0.0% of the limit)"),
])
def test_a_budgets_margin_reads_without_powers_of_ten(over, limit, shown):
    from types import SimpleNamespace

    from fxacct.report.check_text import _margin

    budget = SimpleNamespace(over=over, unit="params", over_fraction=over / limit)
    assert _margin(budget).endswith(shown), _margin(budget)
