"""fxacct.testing: `assert_fits` and `assert_flops` pass quietly, or raise an AssertionError whose
message is the `fxacct check` table, on a meta-built model (nothing allocated)."""

from __future__ import annotations

import pytest
import torch

from examples.mlp import MLP
from fxacct.errors import UsageError
from fxacct.testing import assert_fits, assert_flops

# d_model 64, d_hidden 128, 2 blocks: 33,536 parameters (2 · (128 + 8,320 + 8,256) + 128);
# forward matmul FLOPs per example 2 blocks · 2 mm · 2·64·128 = 65,536, backward twice that.
PARAMS = 2 * (128 + 8_320 + 8_256) + 128
MATMUL_PER_EXAMPLE = 65_536 + 2 * 65_536
H100_REPORTED = 81_559 * 2**20  # bytes, nvidia-smi memory.total of an H100 80GB


@pytest.fixture(scope="module")
def mlp():
    with torch.device("meta"):
        return MLP(d_model=64, d_hidden=128, n_blocks=2)


@pytest.fixture(scope="module")
def x():
    return torch.empty(4, 64, device="meta")


def test_assert_fits_passes_on_an_h100(mlp, x):
    result = assert_fits(mlp, x, gpu="h100", optimizer="adamw", amp="bf16", world_size=8, shard="zero2")
    memory = result.budgets[0]
    assert result.ok and memory.limit == H100_REPORTED, result
    assert "zero2 over 8" in memory.what, memory
    assert not any(p.device.type != "meta" for p in mlp.parameters()), "the model is left on meta"


def test_assert_fits_fails_with_the_table(mlp, x):
    # the fp32 parameters alone are 33,536 · 4 = 134,144 B > 100 KB = 100,000 B
    with pytest.raises(AssertionError) as info:
        assert_fits(mlp, x, max_memory="100KB")
    message = str(info.value)
    assert "memory" in message and "100,000 B" in message and "OVER" in message, message
    assert "FAILED: 1 of 1 budget(s) over (memory)" in message, message


def test_assert_flops_passes_and_fails(mlp, x):
    # batch 4 from the input's first dim; per example ≥ 196,608 matmul FLOPs
    result = assert_flops(mlp, x, max_flops_per_example=10**6, max_params=PARAMS)
    per_example = next(b for b in result.budgets if b.name == "flops_per_example")
    assert per_example.value >= MATMUL_PER_EXAMPLE, result
    with pytest.raises(AssertionError) as info:
        assert_flops(mlp, x, max_params=PARAMS - 1)
    assert "params" in str(info.value) and "over 1 (0.003% of the limit)" in str(info.value), str(info.value)
    with pytest.raises(AssertionError, match="flops"):
        assert_flops(mlp, x, max_flops=4 * MATMUL_PER_EXAMPLE - 1)


def test_assert_flops_with_a_gpu_checks_no_memory_unasked(mlp, x):
    result = assert_flops(mlp, x, gpu="h100", max_step_time=1e-3, mfu=0.5)
    assert [b.name for b in result.budgets] == ["step_time"], result


def test_keyword_inputs_and_an_explicit_batch(mlp):
    result = assert_flops(mlp, {"x": torch.empty(2, 64, device="meta")}, max_params=10**6)
    assert result.ok


def test_assert_flops_without_a_budget_is_a_usage_error(mlp, x):
    with pytest.raises(UsageError, match="needs a budget"):
        assert_flops(mlp, x)


def test_a_size_assert_fits_cannot_read_is_a_usage_error(mlp, x):
    """'80 gigs' raised parse_bytes' bare ValueError, where every other bad argument of the helpers
    is a UsageError; its message (the units it takes) is kept."""
    with pytest.raises(UsageError, match=r"max_memory='80 gigs' is not a byte size: write a number with a unit"):
        assert_fits(mlp, x, gpu="h100", max_memory="80 gigs")
