"""GPU models: capacity, peak FLOP/s per dtype, memory bandwidth, and what a kernel achieves of
them. One table, every number sourced.

Units: FLOP/s and bytes/s as plain floats (989.5e12 = 989.5 TFLOP/s); capacities in bytes.
`capacity_nominal` is the marketed figure in GB (10**9 bytes: an "80 GB" H100 is 80e9 bytes, as
the seeds' back-of-envelope sums use it). `capacity_reported` is what the driver reports
(nvidia-smi memory.total, in MiB = 2**20 bytes, the figure torch.cuda.get_device_properties
returns); fits verdicts use it. Peaks are dense (no 2:4 sparsity): a datasheet's sparse figure
halved. Tensor-core peaks (tf32, bf16, fp16, fp8) apply to the matmul and attention FLOP classes
only; other ops run at the non-tensor fp32 rate.

What kernels achieve (fxacct.predict.gpu_kernels reads these):
- `sm_count`: streaming multiprocessors, the unit GEMM tiles are scheduled on (wave quantization).
- `arch`: compute capability ("sm80", "sm89", "sm90", "sm100"): which attention backend torch's
  SDPA picks and which published attention measurements apply.
- `matmul_efficiency`: dtype key -> the fraction of the datasheet peak cuBLAS reaches on a GEMM
  whose tiles fill every wave: the "Maximum Achievable Matmul FLOPS" (MAMF) table of S. Bekman,
  ml-engineering, compute/accelerator/README.md (mean of 100 iterations of the best shape of a
  shape sweep, `mamf-finder.py`), MAMF / theory.
- `bandwidth_share`: the fraction of the datasheet memory bandwidth a streaming kernel reaches.
- `sources`: field name -> where its figure comes from; `source`: the datasheet and driver report
  of capacity, peaks and bandwidth.

Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM, PCIe and NVL columns, sparsity halved);
NVIDIA H200 datasheet; NVIDIA A100 datasheet (80GB SXM4, 40GB SXM4); NVIDIA HGX B200 datasheet
(per-GPU column); NVIDIA L40S datasheet; memory.total as printed by nvidia-smi on each SKU (H100
80GB HBM3: 81559 MiB, H200: 143771 MiB, A100-SXM4-80GB: 81920 MiB, A100-SXM4-40GB: 40960 MiB,
B200: 183359 MiB, L40S: 46068 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fxacct.errors import UsageError

if TYPE_CHECKING:
    import torch

MiB = 2**20
# Per-op overhead of eager PyTorch on a GPU, in seconds: a short kernel issued back to back in a
# stream is bound by its launch, a few µs each (NVIDIA Technical Blog, A. Gray, "Getting Started with
# CUDA Graphs", 2019: the motivation of CUDA Graphs); 4 µs is that order of magnitude, not a
# per-SKU datasheet figure. `fxacct calibrate --device cuda` measures the local GPU's own.
LAUNCH_S = 4e-6
LAUNCH_SOURCE = "~4 µs per kernel launch (NVIDIA, Getting Started with CUDA Graphs, 2019)"


@dataclass(frozen=True)
class Device:
    name: str
    capacity_nominal: int  # bytes, marketed GB x 1e9
    capacity_reported: int  # bytes, as the driver reports
    bandwidth: float  # bytes/s of device memory
    peak_flops: dict  # dtype name -> dense FLOP/s on tensor cores ("float32": the non-tensor rate)
    cuda: bool = True
    source: str = ""  # the datasheet (and driver report) the figures come from
    launch_s: float = LAUNCH_S  # seconds of overhead per op (kernel launch), LAUNCH_SOURCE
    sm_count: int = 0  # streaming multiprocessors (0: not a GPU of the kernel model)
    arch: str = ""  # compute capability, "sm90"
    matmul_efficiency: dict = field(default_factory=dict)  # dtype key -> achievable fraction of peak (MAMF)
    bandwidth_share: float = 1.0  # achievable fraction of `bandwidth` for a streaming kernel
    sources: dict = field(default_factory=dict)  # field name -> its source
    # which kernel torch's SDPA runs (SDPA_BACKENDS): "auto" is torch 2.13's own choice on this
    # GPU (fxacct.predict.gpu_kernels.attention_backend); --sdpa-backend names another
    sdpa_backend: str = "auto"

    @staticmethod
    def _peak_key(dtype: torch.dtype) -> str:
        key = str(dtype).removeprefix("torch.")
        return "float8" if key.startswith("float8") else key

    def has_peak(self, dtype: torch.dtype) -> bool:
        """Whether the datasheet gives a matmul rate in ``dtype`` (else matmul_peak takes float32's)."""
        return self._peak_key(dtype) in self.peak_flops

    def matmul_peak(self, dtype: torch.dtype | None) -> float:
        """Tensor-core peak for a matmul in ``dtype`` (float32 matmuls: TF32, PyTorch's default for
        cuDNN convolutions; torch.backends.cuda.matmul.allow_tf32 is off by default, so fp32 mm
        runs at the float32 rate); None (no --dtype or --amp: the model's own float32) the float32 rate."""
        if dtype is None:
            return self.peak_flops["float32"]
        return self.peak_flops.get(self._peak_key(dtype), self.peak_flops["float32"])


# --sdpa-backend: "auto" (what torch 2.13's SDPA picks on the GPU), or the backend a run forces
# (torch.nn.attention.sdpa_kernel) or an older torch picked (torch before 2.9 ran flash on H100:
# fxacct.predict.gpu_kernels.CUDNN_FIRST_ARCHS)
SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient")


# --- what kernels achieve, each with its source -------------------------------------------------
# MAMF / theoretical peak, BF16 and FP8 tables of S. Bekman, ml-engineering,
# compute/accelerator/README.md "Maximum Achievable Matmul FLOPS comparison table"
# (https://github.com/stas00/ml-engineering/tree/master/compute/accelerator), measured with
# torch + cuBLAS (mamf-finder.py, mean of 100 iterations of the best shape):
MAMF_A100_BF16 = 271.2 / 312  # A100 SXM, torch 2.6.0+cu126: 86.9%
MAMF_H100_BF16 = 794.5 / 989  # H100 SXM, torch 2.7.0+cu126: 80.3% (the table: "H200 is the same")
MAMF_B200_BF16 = 1745.0 / 2250  # B200 SXM, torch 2.7.1+cu128: 77.6%
MAMF_H100_FP8 = 1402.6 / 1979  # H100 SXM, float8_e4m3fn: 70.9%
MAMF_H200_FP8 = 1453.4 / 1979  # H200 SXM, float8_e4m3fn: 73.4%
MAMF_B200_FP8 = 3432.5 / 4500  # B200 SXM, float8_e4m3fn: 76.3%
MAMF_SOURCE = ("ml-engineering MAMF table (S. Bekman, compute/accelerator/README.md), MAMF / theory; "
               "fp16, tf32 and fp32 have no MAMF row and take the bf16 fraction")
# The share of the datasheet bandwidth a streaming kernel reaches: clpeak's coalesced read,
# 3614.60 GB/s, on a GH200's H100 96GB HBM3 whose datasheet bandwidth is 4.0 TB/s (NVIDIA GH200
# datasheet), repository mredenti/PowerCapping, configuration/OpenCL_benchmark.md: 90.4%.
HBM_SHARE = 3614.60e9 / 4.0e12
HBM_SHARE_SOURCE = ("clpeak coalesced read 3614.60 GB/s of 4.0 TB/s on GH200's H100 96GB "
                    "(mredenti/PowerCapping configuration/OpenCL_benchmark.md)")


def _matmul_efficiency(bf16: float, fp8: float | None = None) -> dict:
    """dtype key -> MAMF fraction: fp16, tf32 and fp32 take bf16's (MAMF_SOURCE)."""
    eff = {"bfloat16": bf16, "float16": bf16, "tf32": bf16, "float32": bf16}
    return eff | ({"float8": fp8} if fp8 is not None else {})


def _sources(sm: str, mamf: str, share: str = HBM_SHARE_SOURCE) -> dict:
    return {"sm_count": sm, "matmul_efficiency": mamf, "bandwidth_share": share,
            "launch_s": LAUNCH_SOURCE}


_H100_SM = "NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3: H100 SXM5 132 SMs"
_HOPPER_PEAKS = {"float64": 67e12, "float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.5e12,
                 "float16": 989.5e12, "float8": 1979e12}
_A100_PEAKS = {"float64": 19.5e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12}
_A100_SM = "NVIDIA A100 Tensor Core GPU Architecture whitepaper: A100 108 SMs"
_A100_MAMF = f"{MAMF_SOURCE}: A100 SXM bf16 271.2 / 312"
# The H100 of torchtitan's published runs (benchmarks/llama3_h100_202412_torchtitan.md): Grand Teton,
# "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "default 500W power limit", and its footnote:
# "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value". No public
# source gives its clocks, so each peak is DERIVED from that bracket at the stated 500 W: the H100
# datasheet's SXM column (700 W) and NVL column (its maximum TDP, 400 W; NVL dense: fp64/fp32 60,
# tf32 835 / 2, bf16 1,671 / 2, fp8 3,341 / 2 TFLOP/s), interpolated linearly in board power:
# NVL + (SXM - NVL) x (500 - 400) / (700 - 400); bf16 835.5 + 154 / 3 = 886.8 TFLOP/s. (Both columns
# are the same 132-SM die at the clock NVIDIA rates for that power: 1.83 and 1.545 GHz.) 132 SMs as
# the SXM5 board. Reported capacity DERIVED: 96 GiB less the 361 MiB the driver holds back on the
# 80 GB SXM5 (81920 - 81559 MiB) = 97943 MiB.
_NVL_PEAKS = {"float64": 60e12, "float32": 60e12, "tf32": 417.5e12, "bfloat16": 835.5e12, "float16": 835.5e12,
              "float8": 1670.5e12}
_SXM_W, _NVL_W, _GRAND_TETON_W = 700, 400, 500  # H100 datasheet max TDPs; torchtitan's power limit
_H100_96GB_PEAKS = {k: _NVL_PEAKS[k] + (_HOPPER_PEAKS[k] - _NVL_PEAKS[k]) * (_GRAND_TETON_W - _NVL_W) / (_SXM_W - _NVL_W)
                    for k in _HOPPER_PEAKS}

DEVICES: dict[str, Device] = {
    "h100": Device("NVIDIA H100 SXM5 80GB", 80 * 10**9, 81559 * MiB, 3.35e12, dict(_HOPPER_PEAKS),
                   source="NVIDIA H100 datasheet, SXM column, dense (sparse / 2); nvidia-smi 81559 MiB",
                   sm_count=132, arch="sm90", matmul_efficiency=_matmul_efficiency(MAMF_H100_BF16, MAMF_H100_FP8),
                   bandwidth_share=HBM_SHARE,
                   sources=_sources(_H100_SM, f"{MAMF_SOURCE}: H100 SXM bf16 794.5 / 989, fp8 1402.6 / 1979")),
    "h100-96gb": Device("NVIDIA H100 SXM5 96GB HBM2e (500 W)", 96 * 10**9, 97943 * MiB, 2.4e12,
                        _H100_96GB_PEAKS,
                        source=("torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96GB HBM2e, 2.4 TB/s, "
                                "500 W; peaks DERIVED: the H100 datasheet's SXM (700 W) and NVL (400 W) columns "
                                "interpolated linearly in board power at 500 W (torchtitan: 'between SXM and NVL'); "
                                "capacity DERIVED: 96 GiB - 361 MiB = 97943 MiB"),
                        sm_count=132, arch="sm90", matmul_efficiency=_matmul_efficiency(MAMF_H100_BF16, MAMF_H100_FP8),
                        bandwidth_share=HBM_SHARE,
                        sources=_sources(f"{_H100_SM} (the SXM5 board)",
                                         f"{MAMF_SOURCE}: H100 SXM's fractions (no row for this SKU)")),
    "h100-pcie": Device("NVIDIA H100 PCIe 80GB", 80 * 10**9, 81559 * MiB, 2.0e12,
                        {"float64": 51e12, "float32": 51e12, "tf32": 378e12, "bfloat16": 756e12,
                         "float16": 756e12, "float8": 1513e12},
                        source="NVIDIA H100 datasheet, PCIe column, dense (sparse / 2); nvidia-smi 81559 MiB",
                        sm_count=114, arch="sm90",
                        matmul_efficiency=_matmul_efficiency(MAMF_H100_BF16, MAMF_H100_FP8),
                        bandwidth_share=HBM_SHARE,
                        sources=_sources("NVIDIA H100 whitepaper, Table 3: H100 PCIe 114 SMs",
                                         f"{MAMF_SOURCE}: H100 SXM's fractions (no PCIe row)")),
    "h200": Device("NVIDIA H200 SXM 141GB", 141 * 10**9, 143771 * MiB, 4.8e12, dict(_HOPPER_PEAKS),
                   source="NVIDIA H200 datasheet, SXM column, dense (sparse / 2); nvidia-smi 143771 MiB",
                   sm_count=132, arch="sm90", matmul_efficiency=_matmul_efficiency(MAMF_H100_BF16, MAMF_H200_FP8),
                   bandwidth_share=HBM_SHARE,
                   sources=_sources(f"{_H100_SM} (H200: the same GH100 SXM5 with HBM3e)",
                                    f"{MAMF_SOURCE}: bf16 H100 SXM's ('H200 is the same'), fp8 H200 1453.4 / 1979")),
    "a100": Device("NVIDIA A100 SXM4 80GB", 80 * 10**9, 81920 * MiB, 2.039e12, dict(_A100_PEAKS),
                   source="NVIDIA A100 datasheet, 80GB SXM column, dense; nvidia-smi 81920 MiB",
                   sm_count=108, arch="sm80", matmul_efficiency=_matmul_efficiency(MAMF_A100_BF16),
                   bandwidth_share=HBM_SHARE, sources=_sources(_A100_SM, _A100_MAMF)),
    "a100-40gb": Device("NVIDIA A100 SXM4 40GB", 40 * 10**9, 40960 * MiB, 1.555e12, dict(_A100_PEAKS),
                        source="NVIDIA A100 datasheet, 40GB SXM column, dense; nvidia-smi 40960 MiB",
                        sm_count=108, arch="sm80", matmul_efficiency=_matmul_efficiency(MAMF_A100_BF16),
                        bandwidth_share=HBM_SHARE, sources=_sources(_A100_SM, _A100_MAMF)),
    # HGX B200 datasheet, per GPU: FP64 37, FP32 75 TFLOP/s; TF32 2.2, BF16/FP16 4.5, FP8 9 PFLOP/s
    # with sparsity (halved here); HBM3e 180 GB, 64 TB/s for 8 GPUs = 8 TB/s each
    "b200": Device("NVIDIA B200 180GB", 180 * 10**9, 183359 * MiB, 8.0e12,
                   {"float64": 37e12, "float32": 75e12, "tf32": 1.1e15, "bfloat16": 2.25e15, "float16": 2.25e15,
                    "float8": 4.5e15},
                   source="NVIDIA HGX B200 datasheet, per-GPU, dense (sparse / 2); nvidia-smi 183359 MiB",
                   sm_count=148, arch="sm100", matmul_efficiency=_matmul_efficiency(MAMF_B200_BF16, MAMF_B200_FP8),
                   bandwidth_share=HBM_SHARE,
                   sources=_sources("148 multiprocessors as the CUDA device query reports on B200 (NVIDIA "
                                    "publishes no SM count for B200)",
                                    f"{MAMF_SOURCE}: B200 SXM bf16 1745.0 / 2250, fp8 3432.5 / 4500",
                                    f"{HBM_SHARE_SOURCE}; assumed for HBM3e")),
    # L40S datasheet: FP32 91.6, TF32 183 (366 sparse), BF16/FP16 362.05 (733 sparse), FP8 733
    # (1,466 sparse) TFLOP/s; 48 GB GDDR6 with ECC, 864 GB/s; 18,176 CUDA cores / 128 per Ada SM = 142 SMs
    "l40s": Device("NVIDIA L40S 48GB", 48 * 10**9, 46068 * MiB, 864e9,
                   {"float32": 91.6e12, "tf32": 183e12, "bfloat16": 362.05e12, "float16": 362.05e12,
                    "float8": 733e12},
                   source="NVIDIA L40S datasheet, dense (sparse / 2); nvidia-smi 46068 MiB",
                   sm_count=142, arch="sm89", matmul_efficiency=_matmul_efficiency(MAMF_A100_BF16),
                   bandwidth_share=HBM_SHARE,
                   sources=_sources("L40S datasheet: 18,176 CUDA cores / 128 per Ada SM = 142 SMs",
                                    f"{MAMF_SOURCE}: no L40S row; A100 SXM's bf16 fraction assumed (the same "
                                    "mma.sync generation of cuBLAS kernels)",
                                    f"{HBM_SHARE_SOURCE}; assumed for GDDR6")),
}
ALIASES = {"h100-sxm": "h100", "a100-80gb": "a100", "h200-sxm": "h200", "h100-hbm2e": "h100-96gb",
           "a100-80": "a100", "a100-40": "a100-40gb", "b200-sxm": "b200"}


def get_device(name: str) -> Device:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise UsageError(f"unknown --gpu {name!r}: use one of {', '.join(DEVICES)}")
    return DEVICES[key]
