"""Memory a training process holds on a GPU besides its tensors, each line with its source: what
lives outside the caching allocator (the CUDA context, NCCL's buffers) and what PyTorch allocates
through it for itself (cuBLAS workspaces), which the replay counts inside reserved.

Per-GPU figures are keyed by fxacct.devices' keys; a key missing here gets the generic line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxacct.devices import ALIASES

MiB, KiB = 2**20, 2**10


@dataclass(frozen=True)
class FixedCost:
    name: str
    bytes: int
    inside_reserved: bool  # allocated through the caching allocator (already in peak_reserved_bytes)
    source: str


# The CUDA context (driver state, the kernels loaded lazily since CUDA 11.7): "around 400MB if CUDA
# >= 11.7 is used and lazy module loading enabled (default in PyTorch)", ptrblck (NVIDIA), pytorch/
# pytorch#109888, 2023-09-23, an nvidia-smi figure (so MiB); the post names no GPU. pytorch/pytorch#107667
# (same author, 2023-08-28) gives "~300MB" for another set-up. The larger figure is taken.
CUDA_CONTEXT_BYTES = 400 * MiB
CUDA_CONTEXT_SOURCE = ("pytorch/pytorch#109888 (ptrblck, NVIDIA, 2023): ~400 MB with CUDA >= 11.7 and lazy "
                       "module loading, as nvidia-smi shows it; the GPU is not named")

# cuBLAS workspace, one per (handle, stream) that runs a GEMM, allocated through the caching allocator
# (aten/src/ATen/cuda/CublasHandlePool.cpp: getNewWorkspace / allocateCUDABlasWorkspace call
# CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())). parseChosenWorkspaceSize, no
# CUBLAS_WORKSPACE_CONFIG: ":4096:8" (32 MiB) on compute capability 9.x and 10.x (Hopper, Blackwell),
# else ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB. cuBLASLt takes its workspace from the same one when
# the workspaces are unified (unified_cublas_and_lt_workspaces, on unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0).
# Handles are per thread (getCurrentCUDABlasHandle: a thread_local PoolWindow reserves one), and
# autograd runs a CUDA backward on its own device thread (torch/csrc/autograd/engine.cpp,
# Engine::start_device_threads, one worker per device), so a training step whose backward runs
# matmuls holds two workspaces on the default stream: the forward thread's, allocated at its first
# matmul, and the backward thread's, at the backward's first. Seen on an H200 (torch 2.11, a GPT-2
# and an MLP step under torch.cuda.memory._record_memory_history): two 32 MiB blocks, at those ops.
CUBLAS_SOURCE = "aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize (torch 2.13), through the allocator"
CUBLAS_THREADS = ("forward thread", "backward thread")  # the backward's: autograd's device thread
# The aten ops that call cuBLAS and so take their thread's workspace: the matrix products
# (aten/src/ATen/native/cuda/Blas.cpp). Convolutions run cuDNN, attention kernels their own.
CUBLAS_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "mv", "addmv", "dot", "vdot", "_scaled_mm"))
HOPPER_WORKSPACE = 4096 * KiB * 8
DEFAULT_WORKSPACE = 4096 * KiB * 2 + 16 * KiB * 8
COMPUTE_CAPABILITY_MAJOR = {  # NVIDIA CUDA GPUs table (developer.nvidia.com/cuda-gpus): H100/H200 9.0, A100 8.0
    "h100": 9, "h100-pcie": 9, "h200": 9, "a100": 8, "a100-40gb": 8}

# NCCL: each communicator keeps, per channel, a buffer to each ring neighbour of NCCL_BUFFSIZE bytes,
# 4 MiB by default (NCCL user guide, Environment Variables, NCCL_BUFFSIZE: "default is 4194304 (4 MiB)").
# NCCL chooses the channel count at init from the topology; one channel is counted, so the line is a
# floor, not a measurement. These buffers are cudaMalloc'ed by NCCL, outside PyTorch's allocator.
NCCL_BUFFSIZE = 4 * MiB
NCCL_RING_PEERS = 2
NCCL_SOURCE = ("NCCL user guide, NCCL_BUFFSIZE default 4 MiB, x 2 ring neighbours, x 1 channel per communicator "
               "(a floor: NCCL picks the channels at init)")


def device_key(name: str) -> str:
    """The fxacct.devices key a --gpu name stands for (its aliases resolved, as get_device does)."""
    key = name.strip().lower()
    return ALIASES.get(key, key)


def cublas_workspace_bytes(gpu: str) -> int:
    return HOPPER_WORKSPACE if COMPUTE_CAPABILITY_MAJOR.get(gpu, 0) in (9, 10) else DEFAULT_WORKSPACE


def outside_allocator(fixed) -> int:
    """The bytes of the lines that live outside the caching allocator (not in peak_reserved_bytes)."""
    return sum(f.bytes for f in fixed if not f.inside_reserved)


def fixed_costs(gpu: str, communicators: int = 0, cublas_threads: tuple[str, ...] = CUBLAS_THREADS[:1]
                ) -> tuple[FixedCost, ...]:
    """The lines for one rank on ``gpu`` (a fxacct.devices key): the CUDA context, the cuBLAS
    workspace of each thread that runs matmuls (``cublas_threads``, of CUBLAS_THREADS), and NCCL's
    buffers for ``communicators`` process groups of more than one rank."""
    workspace = cublas_workspace_bytes(gpu)
    lines = [FixedCost("CUDA context", CUDA_CONTEXT_BYTES, False, CUDA_CONTEXT_SOURCE)]
    lines += [FixedCost(f"cuBLAS/cuBLASLt workspace ({thread})", workspace, True,
                        CUBLAS_SOURCE + (" (compute capability 9.x: 32 MiB)" if workspace == HOPPER_WORKSPACE
                                         else " (:4096:2:16:8)")) for thread in cublas_threads]
    if communicators:
        lines.append(FixedCost(f"NCCL buffers ({communicators} communicator{'s' if communicators > 1 else ''})",
                               communicators * NCCL_BUFFSIZE * NCCL_RING_PEERS, False, NCCL_SOURCE))
    return tuple(lines)
