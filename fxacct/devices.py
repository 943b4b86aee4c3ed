"""GPU models: capacity, peak FLOP/s per dtype, memory bandwidth. One table, every number sourced.

Units: FLOP/s and bytes/s as plain floats (989.5e12 = 989.5 TFLOP/s); capacities in bytes.
`capacity_nominal` is the marketed figure in GB (10**9 bytes: an "80 GB" H100 is 80e9 bytes, as
the seeds' back-of-envelope sums use it). `capacity_reported` is what the driver reports
(nvidia-smi memory.total, in MiB = 2**20 bytes, the figure torch.cuda.get_device_properties
returns); fits verdicts use it. Peaks are dense (no 2:4 sparsity). Tensor-core peaks (tf32,
bf16, fp16, fp8) apply to the matmul and attention FLOP classes only; other ops run at the
non-tensor fp32 rate.

Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe columns, sparsity halved);
NVIDIA H200 datasheet; NVIDIA A100 datasheet (80GB SXM4, 40GB SXM4); memory.total as printed
by nvidia-smi on each SKU (H100 80GB HBM3: 81559 MiB, H200: 143771 MiB, A100-SXM4-80GB: 81920 MiB,
A100-SXM4-40GB: 40960 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def matmul_peak(self, dtype: torch.dtype | None) -> float:
        """Tensor-core peak for a matmul in ``dtype`` (float32 matmuls: TF32, PyTorch's default for
        cuDNN convolutions; torch.backends.cuda.matmul.allow_tf32 is off by default, so fp32 mm
        runs at the float32 rate); None (no --dtype or --amp: the model's own float32) the float32 rate."""
        if dtype is None:
            return self.peak_flops["float32"]
        key = str(dtype).removeprefix("torch.")
        if key.startswith("float8"):
            key = "float8"
        return self.peak_flops.get(key, self.peak_flops["float32"])


DEVICES: dict[str, Device] = {
    "h100": Device("NVIDIA H100 SXM5 80GB", 80 * 10**9, 81559 * MiB, 3.35e12,
                   {"float64": 67e12, "float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.5e12,
                    "float16": 989.5e12, "float8": 1979e12},
                   source="NVIDIA H100 datasheet, SXM column, dense (sparse / 2); nvidia-smi 81559 MiB"),
    "h100-pcie": Device("NVIDIA H100 PCIe 80GB", 80 * 10**9, 81559 * MiB, 2.0e12,
                        {"float64": 51e12, "float32": 51e12, "tf32": 378e12, "bfloat16": 756e12,
                         "float16": 756e12, "float8": 1513e12},
                        source="NVIDIA H100 datasheet, PCIe column, dense (sparse / 2); nvidia-smi 81559 MiB"),
    "h200": Device("NVIDIA H200 SXM 141GB", 141 * 10**9, 143771 * MiB, 4.8e12,
                   {"float64": 67e12, "float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.5e12,
                    "float16": 989.5e12, "float8": 1979e12},
                   source="NVIDIA H200 datasheet, SXM column, dense (sparse / 2); nvidia-smi 143771 MiB"),
    "a100": Device("NVIDIA A100 SXM4 80GB", 80 * 10**9, 81920 * MiB, 2.039e12,
                   {"float64": 19.5e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12,
                    "float16": 312e12},
                   source="NVIDIA A100 datasheet, 80GB SXM column, dense; nvidia-smi 81920 MiB"),
    "a100-40gb": Device("NVIDIA A100 SXM4 40GB", 40 * 10**9, 40960 * MiB, 1.555e12,
                        {"float64": 19.5e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12,
                         "float16": 312e12},
                        source="NVIDIA A100 datasheet, 40GB SXM column, dense; nvidia-smi 40960 MiB"),
}
ALIASES = {"h100-sxm": "h100", "a100-80gb": "a100", "h200-sxm": "h200"}


def get_device(name: str) -> Device:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise UsageError(f"unknown --gpu {name!r}: use one of {', '.join(DEVICES)}")
    return DEVICES[key]
