"""Before a runtime run: which device, which account to compare against, and whether it fits.

Free memory: CUDA, ``torch.cuda.mem_get_info`` (free bytes as the driver reports them); CPU, the
smaller of the kernel's ``MemAvailable`` (/proc/meminfo, in KiB) and what the cgroup still allows
(``memory.max - memory.current``, cgroup v2), when either is known.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fxacct.errors import ModelError, UsageError
from fxacct.load.config import Config
from fxacct.predict.calibration import check_device
from fxacct.predict.roofline import gpu_key
from fxacct.units import format_bytes


def validate(config: Config, options) -> None:
    if options.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {options.steps}")
    if options.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {options.warmup}")
    if config.target is None:
        raise UsageError("runtime mode needs a PATH.py:Name target: it builds the real model from it")
    if config.shard != "none" or config.world_size != 1:
        raise UsageError("--runtime runs one process on one device: drop --world-size/--shard")
    if config.master_weights:
        raise UsageError("--runtime does not run --master-weights: drop one of them")


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when present, else the CPU; 'cuda' without CUDA is a usage error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N") from None
    check_device(device.type)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: there are {torch.cuda.device_count()} CUDA device(s); "
                             f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        device = torch.device("cuda", index)
    return device


def prediction_config(config: Config, device: torch.device) -> Config:
    """The config whose account a run on ``device`` is compared with: on CUDA without --gpu, the local
    GPU's fxacct.devices entry (its CUDA kernel rules); on the CPU, no --gpu. The largest-batch
    search is skipped (it is not what the run measures)."""
    if device.type == "cpu":
        if config.gpu is not None:
            raise UsageError(f"--gpu {config.gpu} is a CUDA target but --runtime runs on the cpu: "
                             "drop --gpu, or use --device cuda")
        return dataclasses.replace(config, find_max_batch=False)
    gpu = config.gpu or gpu_key(torch.cuda.get_device_name(device))
    return dataclasses.replace(config, gpu=gpu, find_max_batch=False)


def _cgroup_room() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)  # the kernel reports KiB
    except (OSError, ValueError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def check_fits(predicted_peak: int | None, device: torch.device, force: bool) -> None:
    """Refuse (ModelError, exit 3) when the predicted peak exceeds the free memory, unless forced."""
    free = free_bytes(device)
    if force or predicted_peak is None or free is None or predicted_peak <= free:
        return
    raise ModelError(f"the predicted peak {format_bytes(predicted_peak)} exceeds the free memory "
                     f"{format_bytes(free)} on {device}; lower --batch or pass --force to run anyway")


__all__ = ["validate", "resolve_device", "prediction_config", "free_bytes", "check_fits"]
