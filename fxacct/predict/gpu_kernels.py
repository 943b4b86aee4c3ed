"""Kernels as they run on a GPU of the table (fxacct.devices): the achievable time of one op of the
training graph, used for --gpu targets in place of the datasheet roofline (the calibrated CPU path,
fxacct.predict.roofline, does not use it).

Matmuls (mm, addmm, bmm, baddbmm, _scaled_mm; convolutions as implicit GEMMs): an (m×k)·(k×n)
product, ``batch`` of them, on a GPU with S streaming multiprocessors,

    tiles = batch · ⌈m / Tm⌉ · ⌈n / Tn⌉          tile quantization: a partial tile costs a full one
    waves = ⌈tiles / S⌉                           wave quantization: a partial wave costs a full one
    t     = waves · S · (2 · Tm · Tn · k) / (η · P)

(NVIDIA, "Matrix Multiplication Background User's Guide", sections "GPU Implementation" and
"Dimension Quantization Effects", docs.nvidia.com/deeplearning/performance/
dl-performance-matrix-multiplication: each thread block computes one Tm×Tn output tile, the tiles of
one wave run concurrently, one per SM). P is the datasheet peak of the dtype (tensor cores; fp32
matmuls at the fp32 rate, TF32 being off by default for matmuls), η the fraction of it cuBLAS reaches
when every wave is full (Device.matmul_efficiency: measured MAMF / theory, fxacct.devices). The tile
is the largest of the guide's 256×128, 128×128, 128×64 and 64×64 whose count fills every SM once
(tiles ≥ S), else 64×64 with K split over the idle SMs (split-K: one wave of ⌊S / tiles⌋ slices of
⌈k / split⌉): a large tile reuses more data but leaves SMs idle on a small problem (the guide's
trade-off; which tile cuBLAS's heuristics pick is not published, so this rule is ours). A
matrix-vector product (m or n of 1) runs cuBLAS's gemv, untiled, at the fp32 rate.
A convolution is the implicit GEMM of NVIDIA's "Convolutional Layers User's Guide": m = N·Ho·Wo,
n = Cout / groups, k = Cin / groups · kh · kw, batch = groups; its backward (data and weight
gradients, GEMMs of permuted sizes) is charged the forward GEMM's quantization. A matmul takes
max(t, bytes / achievable bandwidth).

Attention (any traced SDPA kernel: the CPU trace's flash kernel stands for what the GPU runs): the
backend torch's SDPA picks on the target (ATTENTION_SOURCE) at its measured rate, by head dim and
key length, from the FlashAttention-3 paper's H100 figures (H100_ATTENTION) or the FlashAttention-2
paper's A100 ones (A100_ATTENTION), linear in log2 of the length between published points and
clamped at the ends; the time is the papers' FLOPs (forward
4·T_q·T_k·d per batch·head, halved when causal; backward 2.5× the forward) over that rate. Other SKUs:
ARCH_ATTENTION. The backward at its own published rate; FlashAttention-2's causal backward, published
for the A100 only, at the non-causal rate times the A100's causal share (causal_backward_share).

Memory-bound ops: bytes / (bandwidth × Device.bandwidth_share). Other FLOPs (pointwise, reductions)
at the non-tensor fp32 peak, each op max(compute, memory). The per-op launch cost stays the
roofline's (Device.launch_s, added to every op that launches a kernel).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxacct.costs.registry import argument
from fxacct.devices import Device
from fxacct.trace.capture import tensor_metas

TILES = ((256, 128), (128, 128), (128, 64), (64, 64))  # Tm × Tn, largest first (module docstring)
GEMM_OPS = {"aten.mm.default": (0, 1), "aten.addmm.default": (1, 2), "aten.bmm.default": (0, 1),
            "aten.baddbmm.default": (1, 2), "aten._scaled_mm.default": (0, 1)}  # op -> (a, b) arg positions

# Which backend SDPA runs: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (pytorch main,
# commit 001f694), priority_order(): cuDNN, flash, efficient, math when check_prefer_cudnn_attention()
# (compute capability 9.x or 10.x and a cuDNN runtime newer than 9.15.0), else flash, efficient, math,
# cuDNN. We assume the cuDNN that torch 2.13's CUDA 13 wheels ship qualifies (the source notes that
# CUDA <= 12.9 wheels ship an older one: there H100/B200 run flash). Flash and cuDNN need fp16/bf16
# and one head dim <= 256 for q, k and v (check_head_dim_size_flash; kCuDNNFrontendSupportsD256). An
# attention the trace ran as the efficient kernel (a mask, fp32: fxacct.trace.targets) stays efficient.
CUDNN_FIRST_ARCHS = ("sm90", "sm100")
ATTENTION_SOURCE = ("torch SDPA priority (sdp_utils.cpp priority_order); FlashAttention-3 paper Figs. 5-6 (H100), "
                    "FlashAttention-2 paper Figs. 5-6 (A100)")

# FlashAttention-3 paper (J. Shah et al., arXiv:2407.08608, 2024), H100 80GB SXM5, BF16, batch ×
# length = 16k tokens, hidden 2048: Figure 5 (forward, head dim 64 / 128 / 256, with and without the
# causal mask) and Figure 6 (backward, without the mask), the TFLOP/s printed on each bar, at key
# lengths ATTENTION_SEQ. "flash" is the FlashAttention-2 bars (torch's flash backend is FA2),
# "cudnn" the cuDNN bars. Curves the figures do not have (a causal backward, a head dim not
# measured) take the nearest published one: the causal backward the non-causal one (FlashAttention-2's
# times its causal share on the A100: causal_backward_share), the head dim the nearest (in log2).
# Papers' FLOP convention (module docstring).
ATTENTION_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
H100_ATTENTION = {  # (backend, direction, causal, head dim) -> TFLOP/s at ATTENTION_SEQ
    ("flash", "forward", False, 64): (282, 306, 318, 321, 322, 324),
    ("flash", "forward", True, 64): (180, 229, 262, 284, 295, 299),
    ("flash", "forward", False, 128): (309, 350, 362, 368, 370, 370),
    ("flash", "forward", True, 128): (191, 260, 298, 319, 333, 335),
    ("flash", "forward", True, 256): (208, 251, 278, 293, 297, 298),
    ("cudnn", "forward", False, 64): (335, 373, 395, 408, 412, 413),
    ("cudnn", "forward", True, 64): (225, 288, 334, 363, 379, 388),
    ("cudnn", "forward", False, 128): (497, 574, 617, 609, 600, 595),
    ("cudnn", "forward", True, 128): (315, 410, 484, 518, 529, 539),
    ("cudnn", "forward", True, 256): (308, 391, 450, 483, 497, 509),
    ("flash", "backward", False, 64): (198, 238, 264, 279, 287, 291),
    ("flash", "backward", False, 128): (214, 260, 291, 310, 318, 322),
    ("cudnn", "backward", False, 64): (266, 348, 395, 417, 432, 433),
    ("cudnn", "backward", False, 128): (305, 408, 465, 499, 518, 516),
}
H100_SXM_BF16 = 989.5e12  # the peak of the GPU the curves were measured on (H100 datasheet, SXM)
# FlashAttention-2 paper (T. Dao, arXiv:2307.08691, 2023), A100 80GB SXM4, BF16/FP16, the same set-up
# (16k tokens, hidden 2048): Figure 5 (forward) and Figure 6 (backward), with and without the causal
# mask, head dim 64 and 128, the FlashAttention-2 bars, TFLOP/s at ATTENTION_SEQ.
A100_ATTENTION = {
    ("flash", "forward", False, 64): (128, 149, 193, 192, 192, 192),
    ("flash", "forward", False, 128): (122, 157, 200, 224, 222, 225),
    ("flash", "forward", True, 64): (115, 131, 167, 177, 181, 185),
    ("flash", "forward", True, 128): (108, 126, 133, 148, 148, 148),
    ("flash", "backward", False, 64): (120, 152, 163, 169, 170, 170),
    ("flash", "backward", False, 128): (114, 175, 187, 193, 196, 196),
    ("flash", "backward", True, 64): (81, 111, 149, 160, 166, 166),
    ("flash", "backward", True, 128): (90, 122, 145, 165, 175, 186),
}
A100_BF16 = 312e12  # A100 datasheet, dense
# Which measurements a SKU takes, scaled by its bf16 peak over the measured GPU's (its clocks and SM
# count, as the datasheet peak scales them): exact for the measured SKUs and the H200 (the H100's
# SMs and clocks), DERIVED for the others (B200: no Blackwell figures in the papers; L40S: Ada runs
# the Ampere flash kernels).
ARCH_MEASUREMENTS = {"sm90": (H100_ATTENTION, H100_SXM_BF16), "sm100": (H100_ATTENTION, H100_SXM_BF16),
                     "sm80": (A100_ATTENTION, A100_BF16), "sm89": (A100_ATTENTION, A100_BF16)}
ARCH_ATTENTION = ("sm90, sm100: FlashAttention-3 paper's H100 figures; sm80, sm89: FlashAttention-2 paper's "
                  "A100 figures; each x the SKU's bf16 peak / the measured GPU's")


@dataclass(frozen=True)
class KernelTime:
    seconds: float  # the op's time on the GPU, without the launch cost
    bound: str  # "compute" or "memory"
    kernel: str  # what ran: "gemm 128x128, 3 waves", "attention cudnn forward", "memory", "pointwise"
    peak_fraction: float | None  # share of the datasheet peak it achieves: FLOP/s for a GEMM or
    #                              attention kernel (its own FLOPs), else bytes/s of a memory-bound op


def _shape(node) -> tuple[int, ...] | None:
    metas = tensor_metas(node.meta.get("val")) if isinstance(node, fx.Node) else []
    return tuple(int(s) for s in metas[0].shape) if metas else None


def gemm_dims(node: fx.Node) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul node's GEMM, a convolution's implicit GEMM; None for others."""
    target = str(node.target)
    if target in GEMM_OPS:
        ia, ib = GEMM_OPS[target]
        a, b = _shape(node.args[ia]), _shape(node.args[ib])
        if not a or not b or len(a) < 2 or len(b) < 2:
            return None
        batch = math.prod(a[:-2]) if len(a) > 2 else 1
        return batch, a[-2], b[-1], a[-1]
    if target in ("aten.convolution.default", "aten.convolution_backward.default"):
        backward = "backward" in target
        out, inp, weight = ((_shape(node.args[0]), _shape(node.args[1]), _shape(node.args[2])) if backward
                            else (_shape(node), _shape(node.args[0]), _shape(node.args[1])))
        groups = int(argument(node.target, node.args, node.kwargs, "groups", 1))
        if not out or not inp or not weight or len(out) < 3:
            return None
        return groups, out[0] * math.prod(out[2:]), out[1] // groups, inp[1] // groups * math.prod(weight[2:])
    return None


@dataclass(frozen=True)
class Quantized:
    tile: tuple[int, int]  # Tm × Tn
    tiles: int  # output tiles, all batches
    split: int  # K split into this many slices (split-K), 1 when the tiles fill the SMs
    waves: int
    executed_flops: int  # waves · SMs · 2·Tm·Tn·⌈k / split⌉: the work the SMs are busy for


def gemm_quantization(batch: int, m: int, n: int, k: int, sms: int) -> Quantized:
    """The tile rule and the quantized work of a GEMM (module docstring). With fewer tiles than SMs
    the K dimension is split across the idle SMs (split-K: CUTLASS's "parallel split-K reduction",
    cuBLAS's split-K and stream-K kernels; Osama et al., "Stream-K", PPoPP 2023), one wave of
    ⌊SMs / tiles⌋ slices per tile, the reduction of the slices not counted."""
    def count(tile):
        return batch * -(-m // tile[0]) * -(-n // tile[1])
    tile = next((t for t in TILES if count(t) >= sms), TILES[-1])
    tiles = count(tile)
    split = max(1, sms // tiles)
    waves = -(-tiles // sms)
    return Quantized(tile, tiles, split, waves, waves * sms * 2 * tile[0] * tile[1] * -(-k // split))


def matmul_key(dtype: torch.dtype | None, convolution: bool = False) -> str:
    """The peak_flops key a matmul in ``dtype`` runs at (fp32: the fp32 rate, a convolution TF32)."""
    key = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    key = "float8" if key.startswith("float8") else key
    return "tf32" if key == "float32" and convolution else key


def matmul_rate(device: Device, key: str) -> float:
    """η · P: the achievable FLOP/s of a full-wave GEMM in ``key``."""
    peak = device.peak_flops.get(key, device.peak_flops["float32"])
    return device.matmul_efficiency.get(key, device.matmul_efficiency.get("bfloat16", 1.0)) * peak


def _interpolate(points, x: float) -> float:
    """y at x over (x, y) points ascending in x: linear in log2 x, clamped at the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0)) * (y1 - y0)
    return points[-1][1]


def attention_backend(device: Device, dtype: torch.dtype | None, head_dim: int) -> str:
    """"cudnn", "flash" or "efficient": what torch's SDPA runs (ATTENTION_SOURCE), or the backend
    --sdpa-backend names (Device.sdpa_backend) where the inputs allow it. torch's own switch,
    TORCH_CUDNN_SDPA_DEPRIORITIZED=1, puts cuDNN last as in torch (check_prefer_cudnn_attention:
    ``c10::utils::check_env(...) != true``, true for the value "1")."""
    if dtype not in (torch.float16, torch.bfloat16) or head_dim > 256:
        return "efficient"
    if device.sdpa_backend != "auto":
        return device.sdpa_backend
    cudnn_first = device.arch in CUDNN_FIRST_ARCHS and os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") != "1"
    return "cudnn" if cudnn_first else "flash"


def published_curve(backend: str, direction: str, causal: bool, head_dim: int,
                    table: dict = H100_ATTENTION) -> tuple[tuple, tuple[int, ...]]:
    """(the key used, TFLOP/s at ATTENTION_SEQ): the nearest published curve of ``table``; a
    backend the table lacks (cuDNN on Ampere) takes its flash curve."""
    keys = [k for k in table if k[:2] == (backend, direction)] or [k for k in table if k[:2] == ("flash", direction)]
    same = [k for k in keys if k[2] == causal] or keys
    key = min(same, key=lambda k: (abs(math.log2(k[3] / head_dim)), k[3]))
    return key, table[key]


def causal_backward_share(head_dim: int, seq: int) -> float:
    """FlashAttention-2's causal backward rate over its non-causal one at ``seq``: the FA-2 paper's
    A100 bars (A100_ATTENTION, Fig. 6, the nearest head dim), the one measurement of the causal
    backward of that kernel. The masked blocks along the diagonal do part of a tile's work at a
    tile's cost, whatever the GPU: the H100's FlashAttention-2 backward, published without the mask
    only, runs causal at its non-causal rate times this share (0.89 at hdim 128 and 8k)."""
    (_, causal), (_, full) = (published_curve("flash", "backward", c, head_dim, A100_ATTENTION) for c in (True, False))
    return _interpolate(tuple(zip(ATTENTION_SEQ, causal)), seq) / _interpolate(tuple(zip(ATTENTION_SEQ, full)), seq)


def attention_rate(device: Device, backend: str, direction: str, causal: bool, head_dim: int,
                   seq: int) -> float:
    """FLOP/s (papers' convention) of an attention kernel on ``device`` at key length ``seq``."""
    table, measured_peak = ARCH_MEASUREMENTS.get(device.arch, (H100_ATTENTION, H100_SXM_BF16))
    key, curve = published_curve(backend, direction, causal, head_dim, table)
    rate = _interpolate(tuple(zip(ATTENTION_SEQ, curve)), seq)
    if causal and not key[2] and key[:2] == ("flash", "backward"):  # no causal curve of the flash backward here
        rate *= causal_backward_share(head_dim, seq)
    return rate * 1e12 * device.peak_flops["bfloat16"] / measured_peak


def attention_dims(node: fx.Node) -> tuple[int, int, int, int, bool, bool] | None:
    """(batch·heads, query length, key length, head dim, causal, backward) of an SDPA node."""
    target = str(node.target)
    backward = "backward" in target
    args = node.args[1:] if backward else node.args
    q, k = _shape(args[0]), _shape(args[1]) if len(args) > 1 else None
    if not q or not k or len(q) != 4 or len(k) != 4:
        return None
    if target.startswith(("aten._flash_attention_", "aten._efficient_attention_")):  # (B, T, H, d) layouts
        b_h, tq, tk = q[0] * q[2], q[1], k[1]
    else:  # (B, H, T, d)
        b_h, tq, tk = q[0] * q[1], q[2], k[2]
    op = node.target
    causal = (bool(argument(op, node.args, node.kwargs, "is_causal", False))
              or argument(op, node.args, node.kwargs, "custom_mask_type", 0) in (1, 2))
    return b_h, tq, tk, q[3], causal, backward


def _attention_seconds(node, flops, dtype, device) -> tuple[float, str, float] | None:
    """(seconds, kernel, the FLOPs the kernel executes: the papers' count, causal halved)."""
    dims = attention_dims(node)
    if dims is None:
        return None
    b_h, tq, tk, d, causal, backward = dims
    # the trace's CUDA rules (fxacct.trace.targets) already chose the efficient kernel for a mask
    backend = "efficient" if "efficient_attention" in str(node.target) else attention_backend(device, dtype, d)
    direction = "backward" if backward else "forward"
    if backend == "efficient":  # no published measurement: the matmul model's full-wave rate
        rate = matmul_rate(device, matmul_key(dtype))
        return flops.attention / rate, f"attention efficient {direction}", flops.attention
    work = 4 * b_h * tq * tk * d * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)  # papers' FLOPs
    rate = attention_rate(device, backend, direction, causal, d, tk)
    return work / rate, f"attention {backend} {direction}", work


def op_time(node: fx.Node, flops, nbytes: int, dtype: torch.dtype | None, device: Device) -> KernelTime:
    """One op's achievable time on ``device`` (module docstring), without its launch cost."""
    memory = nbytes / (device.bandwidth * device.bandwidth_share)
    other = flops.other / device.peak_flops["float32"]
    tensor_flops = flops.matmul + flops.attention
    kernel, compute = ("memory" if nbytes else "pointwise"), other
    if flops.attention:
        timed = _attention_seconds(node, flops, dtype, device)
        if timed is not None:
            compute, kernel = other + timed[0] + flops.matmul / matmul_rate(device, matmul_key(dtype)), timed[1]
            tensor_flops = timed[2] + flops.matmul  # the share of peak in the kernel's own FLOPs
        else:
            compute += tensor_flops / matmul_rate(device, matmul_key(dtype))
    elif flops.matmul:
        key = matmul_key(dtype, "convolution" in str(node.target))
        dims = gemm_dims(node)
        if dims is not None and min(dims[1:3]) == 1:  # a matrix-vector product: cuBLAS's gemv, no tiles
            compute += flops.matmul / device.peak_flops["float32"]
            kernel = "gemv"
        elif dims is not None and min(dims):
            q = gemm_quantization(*dims, device.sm_count)
            # a backward convolution holds two GEMMs: its FLOPs at the forward GEMM's quantization
            compute += flops.matmul * (q.executed_flops / (2 * math.prod(dims))) / matmul_rate(device, key)
            kernel = (f"gemm {q.tile[0]}x{q.tile[1]}, " + (f"split-K {q.split}, " if q.split > 1 else "")
                      + f"{q.waves} wave{'s' if q.waves > 1 else ''}")
        else:
            compute += flops.matmul / matmul_rate(device, key)
            kernel = "gemm"
    seconds = max(compute, memory)
    bound = "compute" if compute >= memory else "memory"
    if not seconds:
        return KernelTime(0.0, bound, kernel, None)
    if tensor_flops:  # a GEMM or attention kernel: FLOP/s over the dtype's peak, whatever bounds it
        peak = device.peak_flops.get(matmul_key(dtype, "convolution" in str(node.target)),
                                     device.peak_flops["float32"])
        return KernelTime(seconds, bound, kernel, tensor_flops / seconds / peak)
    if bound == "memory":
        return KernelTime(seconds, bound, kernel, nbytes / seconds / device.bandwidth)
    return KernelTime(seconds, bound, kernel, flops.other / seconds / device.peak_flops["float32"])


@dataclass(frozen=True)
class KernelTotals:
    kind: str  # "gemm", "attention <backend>", "memory", "pointwise"
    ops: int  # ops, times their repeat count
    seconds: float  # their time without the launch cost
    peak_fraction: float | None  # time-weighted share of the datasheet peak they achieve


def kernel_kind(kernel: str) -> str:
    """'gemm 128x128, 2 waves' -> 'gemm'; 'attention cudnn forward' -> 'attention cudnn'."""
    words = kernel.split(",")[0].split()
    return " ".join(words[:2]) if words and words[0] == "attention" else (words[0] if words else "")


def kernel_totals(ops) -> tuple[KernelTotals, ...]:
    """The step's ops grouped by kernel kind (OpTime.kernel), the largest time first."""
    groups: dict[str, list] = {}
    for op in ops:
        kind = kernel_kind(op.kernel)
        if not kind:
            continue
        g = groups.setdefault(kind, [0, 0.0, 0.0, 0.0])
        run = op.seconds - op.overhead_s
        g[0] += op.calls
        g[1] += run
        if op.peak_fraction is not None:
            g[2] += op.peak_fraction * run
            g[3] += run
    rows = [KernelTotals(k, n, s, w / t if t else None) for k, (n, s, w, t) in groups.items()]
    return tuple(sorted(rows, key=lambda r: -r.seconds))


__all__ = ["KernelTime", "KernelTotals", "op_time", "gemm_dims", "gemm_quantization", "attention_backend",
           "attention_rate", "attention_dims", "published_curve", "Quantized", "matmul_rate", "kernel_totals", "TILES",
           "H100_ATTENTION", "A100_ATTENTION", "ATTENTION_SEQ", "H100_SXM_BF16", "CUDNN_FIRST_ARCHS"]
