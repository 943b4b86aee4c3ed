"""fp8 products (aten._scaled_mm, forward and backward as torchao-style fp8 training runs them) are
matmul FLOPs, equal to FlopCounterMode's; a user's own op gets a formula through the public
fxacct.costs.register, from Python or with --costs PATH.py, and is unsupported until it has one."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner
from helpers import flop_counter_oracle, model_flops

import fxacct
from fxacct.costs import Flops, register
from fxacct_cli.main import cli

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HERE = Path(__file__).resolve().parent
M, K, N = 64, 32, 48


def column_major(t):
    return t.t().contiguous().t()


class Float8MM(torch.autograd.Function):
    """x @ wᵀ with fp8 operands and unit scales, forward and both gradients through _scaled_mm,
    as torchao.float8's Float8Linear does (e4m3 in the forward, e5m2 gradients)."""

    @staticmethod
    def forward(ctx, x, w):
        one = torch.ones((), dtype=torch.float32, device=x.device)
        x8, w8 = x.to(E4M3), w.to(E4M3)
        ctx.save_for_backward(x8, w8)
        return torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x8, w8 = ctx.saved_tensors
        one = torch.ones((), dtype=torch.float32, device=g.device)
        g8 = g.to(E5M2)
        dx = torch._scaled_mm(g8, column_major(w8), one, one, out_dtype=torch.float32)  # (M,N)@(N,K)
        dw = torch._scaled_mm(g8.t().contiguous(), column_major(x8), one, one, out_dtype=torch.float32)
        return dx, dw


class Float8Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(N, K))

    def forward(self, x):
        return Float8MM.apply(x, self.weight)


def test_scaled_mm_forward_and_backward_equal_flop_counter():
    with torch.device("meta"):
        model = Float8Linear()
    x = torch.empty(M, K, device="meta", requires_grad=False)
    p = fxacct.profile_module(model, (x,), {}, fxacct.Config(batch=M, input_requires_grad=True))
    t = p.accounting.totals
    assert "aten._scaled_mm.default" not in p.accounting.unsupported_ops
    assert t.forward.matmul == 2 * M * K * N == 196_608
    assert t.backward.matmul == 2 * 196_608  # dX and dW, each an m·k·n product
    fwd, bwd = flop_counter_oracle(model, (x,), input_grads=True)
    assert (model_flops(t.forward), model_flops(t.backward)) == (fwd, bwd)


# --------------------------------------------------------------------------------------------------
# A user's custom op: defined by tests/models/custom_op_model.py, costed by tests/models/custom_op_costs.py
# --------------------------------------------------------------------------------------------------

MODEL = f"{HERE / 'models' / 'custom_op_model.py'}:SquaredMatmul"
COSTS = str(HERE / "models" / "custom_op_costs.py")


def profile_json(*extra):
    result = CliRunner().invoke(cli, ["profile", MODEL, "--batch", "8", "--format", "json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_custom_op_is_unsupported_then_costed_with_costs_file():
    from fxacct.costs import lookup

    costed = hasattr(torch.ops.fxacct_test, "squared_mm") and lookup(torch.ops.fxacct_test.squared_mm.default)
    before = None if costed else profile_json()
    after = profile_json("--costs", COSTS)
    if before is not None:  # the registry is per process: only a fresh one shows the op unsupported
        assert before["unsupported_ops"] == {"fxacct_test.squared_mm.default": 1}
        assert before["totals"]["forward_flops_by_class"]["matmul"] == 0
    assert after["unsupported_ops"] == {}
    # (8, 16) @ (16, 24): 2·8·16·24 = 6,144 matmul, then 8·24 = 192 squares
    assert after["totals"]["forward_flops_by_class"] == {"matmul": 6_144, "attention": 0, "other": 192}
    assert profile_json("--costs", COSTS)["unsupported_ops"] == {}  # loading the file again is a no-op


def test_bad_costs_files_are_usage_errors(tmp_path):
    missing = CliRunner().invoke(cli, ["profile", MODEL, "--costs", str(tmp_path / "nope.py")])
    assert missing.exit_code == 2 and "--costs" in missing.output
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    result = CliRunner().invoke(cli, ["profile", MODEL, "--costs", str(broken)])
    assert result.exit_code == 2 and "boom" in result.output
    duplicate = tmp_path / "dup.py"
    duplicate.write_text("import torch\nfrom fxacct.costs import register\n"
                         "register(torch.ops.aten.mm)(lambda *a, **k: None)\n")
    result = CliRunner().invoke(cli, ["profile", MODEL, "--costs", str(duplicate)])
    assert result.exit_code == 2 and "already has a cost formula" in result.output


def test_register_rejects_duplicates_and_non_ops():
    with pytest.raises(ValueError, match="already has a cost formula"):
        register(torch.ops.aten.mm)(lambda *a, **k: Flops())
    with pytest.raises(ValueError, match="torch.ops"):
        register("mylib::op")(lambda *a, **k: Flops())


_WRONG_FORMULAS = {  # a --costs formula's body -> what the one error line says of it
    "raise ValueError('cost boom')": "raised ValueError: cost boom; fix it",
    "return 42": "returned 42; return fxacct.costs.Flops(",
    "return Flops(other=-100)": "returned Flops(matmul=0, attention=0, other=-100); return fxacct.costs.Flops(",
}


@pytest.mark.parametrize("body", list(_WRONG_FORMULAS))
def test_a_wrong_formula_in_a_costs_file_is_the_users_to_fix(tmp_path, body):
    """A --costs formula that raises, returns something other than Flops, or a negative count: one
    line naming the file, exit 2 (it was fxacct's internal error, exit 4, or a silent -100 FLOPs).
    Each case defines an op of its own: the registry is the process's."""
    name = f"wrong_{abs(hash(body))}"
    model = tmp_path / "model.py"
    model.write_text(
        "import torch\nimport torch.nn as nn\n\n"
        f"@torch.library.custom_op('fxacct_test_costs::{name}', mutates_args=())\n"
        "def op(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n\n"
        "op.register_fake(lambda x: torch.empty_like(x))\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(4, 4)\n\n"
        f"    def forward(self, x):  # on the input: no gradient through the op\n"
        f"        return self.lin(torch.ops.fxacct_test_costs.{name}(x))\n\n"
        "    def example_inputs(self, batch):\n        return (torch.randn(batch, 4),)\n")
    costs = tmp_path / "costs.py"
    costs.write_text("import torch\nfrom fxacct.costs import Flops, register\n\n"
                     f"@register(torch.ops.fxacct_test_costs.{name})\n"
                     f"def formula(x, *, out_shape, ctx, **kwargs):\n    {body}\n")
    result = CliRunner().invoke(cli, ["profile", f"{model}:M", "--costs", str(costs)])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: --costs {costs}: the formula for fxacct_test_costs.{name}.default ")
    assert _WRONG_FORMULAS[body] in lines[0], lines[0]
