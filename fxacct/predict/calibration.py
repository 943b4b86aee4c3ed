"""A device's calibration: the stored profile of this machine's measured rates (matmul FLOP/s by
dtype and smallest dimension, bandwidth by footprint, convolution and kernel rates, per-op
overheads), where it lives and how it is read back. fxacct.tools.calibrate measures it; the roofline
(fxacct.predict.roofline) reads it.

Where: ``$FXACCT_CACHE_DIR`` if set (tests point it at a tmp dir), else ``$XDG_CACHE_HOME/fxacct``,
else ``~/.cache/fxacct``. One JSON file per device: ``device-cpu.json``, ``device-cuda-<name>.json``.
"""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fxacct.errors import UsageError

SCHEMA = "fxacct.device/1"


@dataclass(frozen=True)
class Calibration:
    kind: str  # "cpu" or "cuda"
    name: str  # CPU model or GPU name
    threads: int  # torch.get_num_threads() during the measurement (CPU)
    torch_version: str
    matmul_flops_per_s: dict  # dtype name ("float32", "tf32", "bfloat16", ...) -> FLOP/s, square
    matmul_by_min_dim: dict  # dtype name -> {str(smallest dimension): FLOP/s}, the square's n included
    bandwidth_bytes_per_s: float  # at the largest buffer (DRAM)
    bandwidth_by_bytes: dict  # str(footprint bytes) -> bytes/s, ascending sizes
    measured_at: str  # ISO 8601, UTC
    sizes: dict  # dtype name -> n of the matmul rate
    seconds: float  # wall time of the whole calibration
    # added later; a profile stored before them loads with the defaults (no convolution curve, no overhead)
    convolution_by_channels: dict = field(default_factory=dict)  # dtype -> {str(channels): FLOP/s}
    dispatch_s_per_op: float | None = None  # seconds each op costs besides its FLOPs and bytes
    spread: dict = field(default_factory=dict)  # measurement -> relative spread of its rounds
    warnings: list = field(default_factory=list)  # figures rejected, measurements that stayed unstable
    profiled_dispatch_s_per_op: float | None = None  # the same under torch.profiler (runtime mode)
    kernel_bytes_per_s: dict = field(default_factory=dict)  # str(aten op) -> bytes/s it moves
    convolution_backward_by_channels: dict = field(default_factory=dict)  # dtype -> {str(channels): FLOP/s}
    op_latency_s: dict = field(default_factory=dict)  # str(aten op) -> fixed seconds per call beyond dispatch
    dispatch_s_by_phase: dict = field(default_factory=dict)  # "forward", "backward", "optimizer" -> s per op
    view_s_per_op: float | None = None  # seconds a view op costs (dispatch alone: the trivial op's time)

def cache_dir() -> Path:
    env = os.environ.get("FXACCT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fxacct"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def local_name(kind: str) -> str:
    return torch.cuda.get_device_name() if kind == "cuda" else cpu_name()


def profile_path(kind: str, name: str | None = None) -> Path:
    if kind == "cpu":
        return cache_dir() / "device-cpu.json"
    return cache_dir() / f"device-cuda-{_slug(name or local_name('cuda'))}.json"


def check_device(device: str) -> str:
    """'cpu' or 'cuda' for a --device value; a usage error when CUDA is asked for and absent."""
    try:
        kind = torch.device(device).type if device not in ("cpu", "cuda") else device
    except RuntimeError:  # not a device torch knows ("tpu", ""): as unsupported as one it knows
        kind = None
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not supported: use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here (torch "
                         f"{torch.__version__}); use --device cpu")
    return kind

def save(cal: Calibration) -> Path:
    """Write the profile atomically (a temporary file, then a rename); a cache dir that cannot be
    written is a one-line usage error."""
    path = profile_path(cal.kind, cal.name)
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"schema": SCHEMA, **asdict(cal)}, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"cannot store the device profile in {path.parent} ({e.strerror or e}); set "
                         "FXACCT_CACHE_DIR to a writable folder") from None
    return path


def load(kind: str, name: str | None = None) -> Calibration | None:
    """The stored profile of the local CPU (kind "cpu") or of the GPU ``name`` (default: the local
    one); None if there is none. A file that is not a valid profile is a one-line usage error."""
    if kind == "cuda" and name is None and not torch.cuda.is_available():
        return None
    path = profile_path(kind, name)
    if not path.is_file():
        return None
    try:
        return parse(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UsageError(f"device profile {path} is unreadable ({e}); rerun fxacct calibrate "
                         f"--device {kind} or delete it") from None


def _positive(field: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{field} is {v!r}, not a positive number")


def _rates(field: str, value, keys_are_ints: bool = False) -> None:
    """A {key: positive number} mapping, or ValueError naming the field."""
    if not isinstance(value, dict):
        raise ValueError(f"{field} is not a mapping")
    for k, v in value.items():
        if keys_are_ints and not str(k).isdigit():
            raise ValueError(f"{field} has a key {k!r} that is not a size")
        _positive(f"{field}[{k!r}]", v)


def parse(data) -> Calibration:
    """A Calibration from a stored document; ValueError or TypeError says what is wrong with it."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    data = dict(data)
    if data.pop("schema", None) != SCHEMA:
        raise ValueError(f"unknown schema, expected {SCHEMA}")
    cal = Calibration(**data)  # TypeError for a missing or unknown field
    if cal.kind not in ("cpu", "cuda"):
        raise ValueError(f"kind is {cal.kind!r}, not cpu or cuda")
    _rates("matmul_flops_per_s", cal.matmul_flops_per_s)
    if "float32" not in cal.matmul_flops_per_s:
        raise ValueError("matmul_flops_per_s has no float32 rate")
    if not isinstance(cal.matmul_by_min_dim, dict):
        raise ValueError("matmul_by_min_dim is not a mapping")
    for key, by_dim in cal.matmul_by_min_dim.items():
        _rates(f"matmul_by_min_dim[{key!r}]", by_dim, keys_are_ints=True)
    _positive("bandwidth_bytes_per_s", cal.bandwidth_bytes_per_s)
    _rates("bandwidth_by_bytes", cal.bandwidth_by_bytes, keys_are_ints=True)
    for name in ("convolution_by_channels", "convolution_backward_by_channels"):
        for key, by_channels in getattr(cal, name).items():
            _rates(f"{name}[{key!r}]", by_channels, keys_are_ints=True)
    if not isinstance(cal.op_latency_s, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in cal.op_latency_s.values()):
        raise ValueError("op_latency_s is not a mapping of op names to seconds >= 0")
    _rates("kernel_bytes_per_s", cal.kernel_bytes_per_s)
    _rates("dispatch_s_by_phase", cal.dispatch_s_by_phase)
    for name in ("dispatch_s_per_op", "profiled_dispatch_s_per_op", "view_s_per_op"):
        if getattr(cal, name) is not None:
            _positive(name, getattr(cal, name))
    return cal

__all__ = ["Calibration", "save", "load", "parse", "cache_dir", "profile_path", "check_device", "local_name",
           "cpu_name", "SCHEMA"]
