"""Target-device rules (``gpu=...``: fxacct.trace.targets) and ZeRO/FSDP partitioning per rank
(fxacct.memory.sharding).

Oracles: what a kernel's autograd node saves is read off the kernel itself, run on meta tensors
under ``saved_tensors_hooks`` (shapes and dtypes only, no GPU needed); CPU-side figures come from a
real eager CPU run; per-rank figures are computed from the real parameter shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import config, meta_input, on_meta, profile_meta, target

import fxacct
from fxacct.memory.peak import CATEGORIES
from fxacct.report.plot import memory_timeline

BF16 = torch.bfloat16
aten = torch.ops.aten


def kernel_saved_bytes(kernel, q_shape, dtype) -> int:
    """Bytes the kernel's autograd node saves besides q, k, v (its own outputs), on meta tensors."""
    q, k, v = (torch.empty(q_shape, dtype=dtype, device="meta", requires_grad=True) for _ in range(3))
    inputs = {t.untyped_storage()._cdata for t in (q, k, v)}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in inputs:
            seen.setdefault(st._cdata, t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = kernel(q, k, v)
    del out
    return sum(seen.values())


def eager_saved_bytes(model: nn.Module, x: torch.Tensor, amp: torch.dtype | None = None) -> dict[str, int]:
    """{dtype name: bytes} autograd saves in a real eager CPU forward (each storage once, parameters
    and buffers excluded)."""
    excluded = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in excluded:
            seen.setdefault(st._cdata, (st.nbytes(), t.dtype))
        return t

    autocast = torch.autocast("cpu", dtype=amp) if amp is not None else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        out = model(x)
    by: dict[str, int] = {}
    for nbytes, dt in seen.values():
        name = str(dt).removeprefix("torch.")
        by[name] = by.get(name, 0) + nbytes
    del out
    return by


def activation_split(p) -> dict[str, int]:
    return {k: v.activation_bytes for k, v in p.memory.by_dtype.items() if v.activation_bytes}


# --------------------------------------------------------------------------------------------------
# Attention on a GPU saves output + logsumexp, never the probability matrix
# --------------------------------------------------------------------------------------------------

# GPT small (tests/helpers.py): n_embd 64, 4 heads (head dim 16), T = block_size 32, batch 2
GPT_Q = (2, 4, 32, 16)
T = 32


def _attention_rows(p):
    return [r for r in p.accounting.nodes if "attention" in r.op]


def test_gpt_h100_fp32_uses_efficient_attention():
    # fp32 q: no flash kernel (fp16/bf16 only), so the memory-efficient kernel: it saves
    # out (2,4,32,16) fp32 = 16,384 B + logsumexp (2,4,32) fp32 = 1,024 B (ceil(32/32)·32 columns)
    # + philox seed and offset, two 0-dim int64 = 16 B → 17,424 B per layer
    p = fxacct.profile(config("GPT", batch=2, gpu="h100", find_max_batch=False))
    expected = kernel_saved_bytes(
        lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True), GPT_Q,
        torch.float32)
    assert expected == 16_384 + 1_024 + 16
    rows = _attention_rows(p)
    assert [r.op for r in rows] == ["aten._scaled_dot_product_efficient_attention.default"] * 2
    assert [r.activation_bytes for r in rows] == [expected] * 2


def test_gpt_h100_bf16_uses_flash_attention():
    # bf16 q, head dim 16 ≤ 256, no mask: flash. Saves out (2,4,32,16) bf16 = 8,192 B + logsumexp
    # (2,4,32) fp32 = 1,024 B + rng state (2,) uint64 = 16 B + (,) uint64 = 8 B → 9,240 B per layer
    for precision in ({"amp": BF16}, {"dtype": BF16}):
        p = fxacct.profile(config("GPT", batch=2, gpu="h100", find_max_batch=False, **precision))
        expected = kernel_saved_bytes(
            lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False), GPT_Q, BF16)
        assert expected == 8_192 + 1_024 + 16 + 8
        rows = _attention_rows(p)
        assert [r.op for r in rows] == ["aten._scaled_dot_product_flash_attention.default"] * 2, precision
        assert [r.activation_bytes for r in rows] == [expected] * 2, precision


def test_no_probability_matrix_is_saved_on_gpu_or_cpu():
    # The math path would save softmax(QKᵀ) of shape (2,4,32,32); neither the CUDA kernels nor CPU
    # flash do.
    for gpu in ("h100", None):
        p = fxacct.profile(config("GPT", batch=2, gpu=gpu, find_max_batch=False))
        assert not [r for r in p.accounting.nodes if r.activation_bytes and tuple(r.shape[-2:]) == (T, T)], gpu


class Sdpa3d(nn.Module):
    """SDPA on (B, T, D) tensors: no head dimension, which every fused kernel needs."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_sdpa_without_a_head_dimension_takes_the_math_path_on_a_gpu():
    # flash, memory-efficient and cuDNN attention take 4-D query/key/value only
    # (ATen/native/transformers/sdp_utils_cpp.h, check_tensor_shapes); 3-D ones run CUDA's math path:
    # QKᵀ and PV as two batched matmuls, 2·B·T·T·D FLOPs each (B=2, T=32, D=16), and the softmax saved
    p = profile_meta(on_meta(Sdpa3d), (meta_input(2, T, 16),), gpu="h100", find_max_batch=False)
    ops = [r.op for r in p.accounting.nodes]
    assert not [op for op in ops if "scaled_dot_product" in op], ops
    assert p.accounting.totals.forward.attention == 2 * (2 * 2 * T * T * 16)
    assert [r for r in p.accounting.nodes if r.activation_bytes and tuple(r.shape[-2:]) == (T, T)]


def test_gpt_cpu_attention_is_cpu_flash():
    # CPU flash saves out 16,384 B + logsumexp 1,024 B, no RNG state
    p = fxacct.profile(config("GPT", batch=2))
    expected = kernel_saved_bytes(
        lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True), GPT_Q, torch.float32)
    assert expected == 17_408
    assert [r.activation_bytes for r in _attention_rows(p)] == [expected] * 2


# --------------------------------------------------------------------------------------------------
# Dropout: CPU saves a full-precision noise tensor, CUDA a 1-byte mask
# --------------------------------------------------------------------------------------------------

class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.drop(self.a(x)))


def test_dropout_cpu_saves_a_float_mask():
    # x (4,16) fp32 256 B (a's weight grad) + noise (4,16) fp32 256 B (dropout's mul) + dropout
    # output 256 B (b's weight grad) = 768 B, all float32
    p = profile_meta(on_meta(DropoutNet), (meta_input(4, 16),))
    torch.manual_seed(0)
    assert activation_split(p) == eager_saved_bytes(DropoutNet(), torch.randn(4, 16)) == {"float32": 768}


def test_dropout_gpu_saves_a_bool_mask():
    # native_dropout (CUDA): mask (4,16) bool = 64 B instead of the 256 B noise tensor
    p = profile_meta(on_meta(DropoutNet), (meta_input(4, 16),), gpu="h100", find_max_batch=False)
    assert activation_split(p) == {"float32": 512, "bool": 64}
    (row,) = [r for r in p.accounting.nodes if "dropout" in r.op]
    assert row.op == "aten.native_dropout.default"
    assert row.activation_bytes == 256 + 64  # its output (saved by b) and its mask


# --------------------------------------------------------------------------------------------------
# Autocast: CUDA runs softmax in float32, CPU keeps bfloat16
# --------------------------------------------------------------------------------------------------

class SoftmaxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), -1))


def _softmax_row(p):
    (row,) = [r for r in p.accounting.nodes if "softmax" in r.op]
    return row


def test_amp_softmax_is_bf16_on_cpu():
    # CPU autocast has no softmax in its fp32 list: (4,16) bf16 = 128 B, saved by its backward
    p = profile_meta(on_meta(SoftmaxNet), (meta_input(4, 16),), amp=BF16)
    row = _softmax_row(p)
    assert (row.dtype, row.activation_bytes) == ("bfloat16", 128)
    torch.manual_seed(0)
    assert activation_split(p) == eager_saved_bytes(SoftmaxNet(), torch.randn(4, 16), amp=BF16)


def test_amp_softmax_is_fp32_on_gpu():
    # CUDA autocast's fp32 list has softmax: (4,16) fp32 = 256 B; b then casts it back to bf16 (128 B)
    p = profile_meta(on_meta(SoftmaxNet), (meta_input(4, 16),), amp=BF16, gpu="h100", find_max_batch=False)
    row = _softmax_row(p)
    assert (row.dtype, row.activation_bytes) == ("float32", 256)


# --------------------------------------------------------------------------------------------------
# ZeRO / FSDP: what one rank holds
# --------------------------------------------------------------------------------------------------

# Odd sizes so that a per-tensor ceil(bytes / N) differs from bytes / N.
MLP_KW = dict(d_model=25, d_hidden=49, n_blocks=2)
N = 8


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _mlp_param_bytes() -> tuple[list[int], int]:
    """(fp32 bytes of each parameter tensor, bytes of the largest block) from the real shapes."""
    from examples.mlp import MLP

    model = on_meta(MLP, **MLP_KW)
    sizes = [t.numel() * 4 for t in model.parameters()]
    block = max(sum(t.numel() * 4 for t in b.parameters()) for b in model.blocks)
    return sizes, block


def _sharded(shard: str, **extra):
    cfg = fxacct.Config(target=target("examples/mlp.py:MLP"), batch=2, kwargs=dict(MLP_KW), optimizer="adam",
                        amp=BF16, world_size=N if shard != "none" else 1, shard=shard, **extra)
    return fxacct.profile(cfg)


def test_unsharded_totals_are_the_real_tensors():
    sizes, block = _mlp_param_bytes()
    # per block: LayerNorm 2·25 + fc1 25·49 + 49 + fc2 49·25 + 25 = 2,574 params; ×2 + final LN 50 = 5,198
    assert sum(sizes) == 4 * 5_198 and block == 4 * 2_574
    f32 = _sharded("none").memory.by_dtype["float32"]
    assert f32.param_bytes == f32.grad_bytes == sum(sizes)
    # Adam: exp_avg + exp_avg_sq per parameter, and a 0-dim fp32 `step` per tensor (14 tensors)
    assert f32.optimizer_bytes == 2 * sum(sizes) + 4 * len(sizes)


def _expected_rank(shard: str, sizes: list[int], block: int) -> dict:
    """Resident bytes on one rank, per category (gradients: once all exist, at the step's end)."""
    full = shard in ("zero3", "fsdp")
    return {
        "optimizer_state": sum(2 * ceil_div(s, N) + ceil_div(4, N) for s in sizes),
        "gradients": sum(ceil_div(s, N) for s in sizes) if shard != "zero1" else sum(sizes),
        "parameters": sum(ceil_div(s, N) for s in sizes) + block if full else sum(sizes),
    }


def _check_rank(shard: str):
    sizes, block = _mlp_param_bytes()
    base, p = _sharded("none"), _sharded(shard)
    m = p.memory
    expected = _expected_rank(shard, sizes, block)
    timeline, unsharded = memory_timeline(p), memory_timeline(base)
    assert [n for n, _, _ in timeline] == [n for n, _, _ in unsharded]
    for (name, _, live), (_, _, full) in zip(timeline, unsharded):
        # resident, partitioned categories: the same at every op
        assert live["optimizer_state"] == expected["optimizer_state"], name
        assert live["parameters"] == expected["parameters"], name
        # nothing else is partitioned
        for c in ("inputs", "buffers", "activations", "temporaries", "master_weights"):
            assert live[c] == full[c], (name, c)
        if shard == "zero1":
            assert live["gradients"] == full["gradients"], name
    assert timeline[-1][2]["gradients"] == expected["gradients"]  # after the backward all gradients exist
    # the per-rank peak holds the partitioned resident parts by the closed forms above, and is
    # below the single-rank peak (a figure from the unsharded walk, not from this one)
    assert [c for c, _ in m.per_rank.by_category] == list(CATEGORIES)
    assert m.per_rank.category("optimizer_state") == expected["optimizer_state"]
    assert m.per_rank.category("parameters") == expected["parameters"]
    assert m.per_rank.bytes < base.memory.peak_train.bytes
    assert m.peak_train == base.memory.peak_train  # the single-rank account is unchanged
    assert m.rank_peak == m.per_rank
    return m, block


def test_zero1_partitions_optimizer_state():
    m, _ = _check_rank("zero1")
    assert m.gathered_unit is None


def test_zero2_also_partitions_gradients():
    m, _ = _check_rank("zero2")
    assert m.gathered_unit is None


def test_zero3_also_partitions_parameters_and_gathers_one_block():
    m, block = _check_rank("zero3")
    assert m.gathered_unit == ("blocks.0", block)


def test_blocks_kept_in_a_module_dict_are_the_gathered_units():
    """examples/llama.py keeps its blocks in an nn.ModuleDict, as torchtitan's models do: each
    block is a unit FSDP gathers alone. The whole ``layers`` container was taken for one unit, so
    a rank of 8 held 94% of the model's parameters (more than all of them at 2 blocks). By hand:
    a block of dim 64, hidden 128, 4 heads of 16, 2 kv heads: wq and wo 64x64, wk and wv 64x32,
    w1, w3 128x64 and w2 64x128, two norms of 64: 36,992 fp32 parameters, 147,968 B."""
    cfg = fxacct.Config(target=target("examples/llama.py:Llama"), batch=2, kwargs=dict(n_layers=8), world_size=8,
                        shard="fsdp")
    m = fxacct.profile(cfg).memory
    block = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 128 * 64 + 2 * 64)
    assert m.gathered_unit == ("layers.0", block) == ("layers.0", 147_968)
    assert m.per_rank.category("parameters") == m.param_bytes // 8 + block


def test_fsdp_is_zero3():
    a, b = _sharded("zero3").memory, _sharded("fsdp").memory
    assert (a.per_rank, a.gathered_unit) == (b.per_rank, b.gathered_unit)


def test_zero1_mixed_precision_adam_matches_the_paper():
    # ZeRO §5 (Rajbhandari et al. 2020), mixed-precision Adam, stage 1: 2Ψ bf16 parameters + 2Ψ bf16
    # gradients resident; fp32 master (4Ψ) and Adam moments (8Ψ) partitioned: 12Ψ/N — per tensor
    # ceil, plus torch's 0-dim fp32 `step` per tensor (ceil(4/N) = 1 B per rank).
    sizes, _ = _mlp_param_bytes()
    numels = [s // 4 for s in sizes]
    p = fxacct.profile(fxacct.Config(target=target("examples/mlp.py:MLP"), batch=2, kwargs=dict(MLP_KW),
                                     optimizer="adam", dtype=BF16, master_weights=True, world_size=N, shard="zero1"))
    timeline = memory_timeline(p)
    start = timeline[0][2]
    assert start["parameters"] == sum(2 * n for n in numels)
    assert start["master_weights"] == sum(ceil_div(4 * n, N) for n in numels)
    assert start["optimizer_state"] == sum(2 * ceil_div(4 * n, N) + ceil_div(4, N) for n in numels)
    assert timeline[-1][2]["gradients"] == sum(2 * n for n in numels)


# --------------------------------------------------------------------------------------------------
# Fit on a GPU: the largest batch that fits does, and one more does not
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_on_h100():
    return fxacct.profile(config("GPT", batch=2, gpu="h100"))


def test_fit_headroom(gpt_on_h100):
    m = gpt_on_h100.memory
    assert m.fit.capacity_bytes == 81_559 * 2**20  # nvidia-smi memory.total of an H100 80GB HBM3
    # a CUDA target fits what the caching allocator reserves plus the fixed costs outside it
    assert m.fit.peak_bytes == m.reserved.peak_reserved_bytes + m.reserved.fixed_outside_bytes
    assert m.reserved.peak_reserved_bytes >= m.rank_peak.bytes
    assert m.fit.headroom_bytes == m.fit.capacity_bytes - m.fit.peak_bytes
    assert m.fit.max_batch is not None and m.fit.max_batch_verified
    at = fxacct.profile(config("GPT", batch=m.fit.max_batch, gpu="h100", find_max_batch=False))
    assert at.memory.fit_bytes <= m.fit.capacity_bytes


# The per-rank peak of GPT small is not affine from batch 2 up: at batch 2 it is in the optimizer
# step, at large batches in the backward (peak(2) = 2,171,508, peak(4) = 2,616,472, peak(6) =
# 3,227,288). The first guess from b and 2b (384,386) does not fit; the secant step then takes
# `... - 1` and stopped at the first batch that fits (regression: it reported 280,015; 280,016 fits).
def test_largest_batch_that_fits_is_the_largest(gpt_on_h100):
    fit = gpt_on_h100.memory.fit
    above = fxacct.profile(config("GPT", batch=fit.max_batch + 1, gpu="h100", find_max_batch=False))
    assert above.memory.fit_bytes > fit.capacity_bytes
