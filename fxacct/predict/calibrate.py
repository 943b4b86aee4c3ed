"""Calibrate: measure this machine's achievable matmul FLOP/s per dtype and its memory bandwidth
with short microbenchmarks, and keep the result as a device profile in the user cache dir.

Predictions (fxacct.predict.roofline) use the profile for this CPU when no ``--gpu`` is given, and for the
local GPU in runtime mode. Without one, the CPU has no device model and predicted times are null
("not calibrated"), never a made-up number.

What is measured (each the best of repetitions that fill a small time budget: on a shared machine
other work only ever slows a repetition down, so the fastest is the device's own rate):

- matmul FLOP/s per dtype: ``a @ b`` on square n×n operands, 2·n³ FLOPs each (1 FMA = 2 FLOPs,
  fxacct.units). n grows from ``MIN_N`` by doubling until one product takes ``MIN_OP_S`` or n
  reaches the device's cap, and the rate at that n is kept: a sustained rate. Smaller products that fit in
  cache can run faster for a moment (on the 2-core CI machine 512² reached 3× the 2048² rate),
  which no model-sized matmul sustains. float32 on CUDA runs with TF32 off (PyTorch's default for
  matmuls); "tf32" is the same product with it on.
- the same by smallest dimension: (d×n) @ (n×n) for d in ``SKINNY_DIMS``, and the square's n
  (its own smallest dimension). ``MIN_N`` is twice the largest d, so on any machine, however slow,
  the square's n lies above every d: the classes of the curve never coincide. A
  matmul with one small dimension (a batch of 64 rows through a 1024→4096 layer, and the weight
  gradient that contracts over those 64) runs well below the square rate on a CPU (measured here:
  ~half); predictions look the rate up by each matmul's smallest dimension (fxacct.predict.roofline).
- bandwidth in bytes/s, by footprint: three streaming ops, ``dst.copy_(src)`` (reads and writes
  the buffer: 2 × its bytes moved, the STREAM "copy" convention), ``torch.add(a, b, out=c)`` (3 ×)
  and ``a.mul_(s)`` (2 ×), on buffers of ``COPY_SIZES``; per size, the median of the three rates,
  keyed by the footprint of a copy (2 × the buffer). Two sweeps; per size the faster is kept. On a
  CPU a footprint that fits in the last-level cache streams several times faster than DRAM, and
  predictions look the rate up by the step's working set (fxacct.predict.roofline).
  ``bandwidth_bytes_per_s`` is the rate at the largest size (DRAM).

Where: ``$FXACCT_CACHE_DIR`` if set (tests point it at a tmp dir), else ``$XDG_CACHE_HOME/fxacct``,
else ``~/.cache/fxacct``. One JSON file per device: ``device-cpu.json``, ``device-cuda-<name>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from fxacct.errors import UsageError

SCHEMA = "fxacct.device/1"
MIN_OP_S = 0.01  # s: a product this long is timed reliably and runs at a sustained rate
BUDGET_S = 0.3  # s per measurement: repetitions stop once their total passes it
MAX_N = {"cpu": 2048, "cuda": 8192}  # largest square operand tried (2048² fp32 = 16 MiB each)
# buffer sizes of the bandwidth ops: from L2-resident (1 MiB) to past the last-level cache of current
# server CPUs (hundreds of MiB); on a GPU one size far past its L2 (50 MiB on H100)
COPY_SIZES = {"cpu": tuple(2**20 * m for m in (1, 4, 16, 64, 256)), "cuda": (2**30,)}
SKINNY_DIMS = (16, 64, 256)  # the small dimension of the (d×n) @ (n×n) products
MIN_N = 2 * max(SKINNY_DIMS)  # first square n tried: above every skinny d (512² fp32 = 1 MiB each)
DTYPES = {"cpu": ("float32", "bfloat16", "float16"),
          "cuda": ("float32", "tf32", "bfloat16", "float16")}


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
    kind = torch.device(device).type if device not in ("cpu", "cuda") else device
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not supported: use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here (torch "
                         f"{torch.__version__}); use --device cpu")
    return kind


class _Timer:
    """Seconds of fn(), synchronized on CUDA."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.kind == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # elapsed_time is in ms
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _repeat(timer: _Timer, fn, budget_s: float) -> float:
    """The fastest seconds of fn() over repetitions that fill budget_s (at least 3), after one warm-up."""
    fn()
    times, spent = [], 0.0
    while len(times) < 3 or spent < budget_s:
        t = timer(fn)
        times.append(t)
        spent += t
        if len(times) >= 200:
            break
    return min(times)


def measure_matmul(kind: str, dtype_key: str, budget_s: float = BUDGET_S) -> tuple[float, int]:
    """(FLOP/s, n) of n×n @ n×n products in dtype_key, at the first n whose product takes MIN_OP_S."""
    timer = _Timer(kind)
    dtype = torch.float32 if dtype_key == "tf32" else getattr(torch, dtype_key)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype_key == "tf32"
    n = MIN_N
    try:
        while True:
            a = torch.randn(n, n, device=kind).to(dtype)
            b = torch.randn(n, n, device=kind).to(dtype)
            seconds = _repeat(timer, lambda: torch.mm(a, b), budget_s / 3)
            if seconds >= MIN_OP_S or n >= MAX_N[kind]:
                return 2 * n**3 / seconds, n  # 2·n³ FLOPs: n³ multiply-adds
            n *= 2
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def measure_skinny(kind: str, dtype_key: str, n: int, budget_s: float = BUDGET_S) -> dict[int, float]:
    """{d: FLOP/s} of (d×n) @ (n×n) products for d in SKINNY_DIMS; n must lie above them all, so
    that no d is the square's own class."""
    if n <= max(SKINNY_DIMS):
        raise ValueError(f"square n={n} must exceed every skinny dimension {SKINNY_DIMS}")
    timer = _Timer(kind)
    dtype = torch.float32 if dtype_key == "tf32" else getattr(torch, dtype_key)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype_key == "tf32"
    out = {}
    try:
        b = torch.randn(n, n, device=kind).to(dtype)
        for d in SKINNY_DIMS:
            a = torch.randn(d, n, device=kind).to(dtype)
            out[d] = 2 * d * n * n / _repeat(timer, lambda: torch.mm(a, b), budget_s / 3)  # 2·d·n·n FLOPs
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def measure_bandwidth(kind: str, budget_s: float = BUDGET_S, sweeps: int = 2) -> dict[int, float]:
    """{footprint bytes: bytes/s} over COPY_SIZES (module docstring)."""
    timer = _Timer(kind)
    out: dict[int, float] = {}
    share = budget_s / 3
    for _ in range(sweeps):
        for nbytes in COPY_SIZES[kind]:
            a = torch.ones(nbytes // 4, dtype=torch.float32, device=kind)
            b, c = torch.ones_like(a), torch.ones_like(a)
            rates = [2 * nbytes / _repeat(timer, lambda a=a, c=c: c.copy_(a), share),  # read a, write c
                     3 * nbytes / _repeat(timer, lambda a=a, b=b, c=c: torch.add(a, b, out=c), share),  # a, b -> c
                     2 * nbytes / _repeat(timer, lambda a=a: a.mul_(1.0), share)]  # read and write a
            out[2 * nbytes] = max(out.get(2 * nbytes, 0.0), statistics.median(rates))
            del a, b, c
    return out


def calibrate(device: str = "cpu", budget_s: float = BUDGET_S,
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Measure the local CPU or GPU (a few seconds; < 20 s on 2 CPU cores)."""
    kind = check_device(device)
    t0 = time.perf_counter()
    rates, sizes, by_dim = {}, {}, {}
    with torch.no_grad():
        for key in DTYPES[kind]:
            if progress:
                progress(f"matmul {key}")
            rates[key], sizes[key] = measure_matmul(kind, key, budget_s)
            skinny = measure_skinny(kind, key, sizes[key], budget_s)
            by_dim[key] = {str(d): r for d, r in sorted({**skinny, sizes[key]: rates[key]}.items())}
        if progress:
            progress("memory bandwidth")
        curve = measure_bandwidth(kind, budget_s)
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return Calibration(kind, local_name(kind), torch.get_num_threads(), torch.__version__, rates, by_dim,
                       curve[max(curve)], {str(k): v for k, v in sorted(curve.items())}, now, sizes,
                       time.perf_counter() - t0)


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
    return cal


__all__ = ["Calibration", "calibrate", "save", "load", "parse", "cache_dir", "profile_path", "check_device"]
