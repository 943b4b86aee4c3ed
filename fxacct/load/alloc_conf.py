"""PYTORCH_CUDA_ALLOC_CONF, parsed as torch 2.13 parses it, into the settings the caching-allocator
model (fxacct.memory.allocator) reads.

Sources (torch 2.13 wheel, ``torch/include``; pytorch/pytorch at the same names):
- the tokenizer: c10/core/AllocatorConfig.h ``ConfigTokenizer``: the string splits at ``,`` ``:``
  ``[`` ``]`` (each a token of its own), whitespace is dropped;
- the common keys and their checks: c10/core/AllocatorConfig.{h,cpp}
  ``AcceleratorAllocatorConfig::parseArgs`` and its ``parseMaxSplitSize``,
  ``parseMaxNonSplitRoundingSize``, ``parseLargeSegmentSize``, ``parseGarbageCollectionThreshold``,
  ``parseRoundUpPower2Divisions``, ``parseExpandableSegments``;
- the CUDA keys: c10/cuda/CUDAAllocatorConfig.h ``CUDAAllocatorConfig::getKeys`` and
  c10/cuda/CUDAAllocatorConfig.cpp ``parseArgs``;
- the environment: ``PYTORCH_ALLOC_CONF`` is the primary variable and ``PYTORCH_CUDA_ALLOC_CONF``
  the older one (AllocatorConfig.h, Note [AcceleratorAllocatorConfig design]); fxacct reads
  ``PYTORCH_CUDA_ALLOC_CONF`` first, as CUDAAllocatorConfig::instance does, then ``PYTORCH_ALLOC_CONF``.

Keys the model does not need (pinned host memory, locks, OOM behaviour) are checked and kept, so a
string torch accepts is accepted here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from fxacct.errors import UsageError

MiB = 2**20
KB_LARGE_BUFFER = 20 * MiB  # kLargeBuffer, c10/cuda/CUDACachingAllocator.cpp: "large" allocations packed in 20 MiB
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc, c10/core/AllocatorConfig.h
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals, AllocatorConfig.cpp: 1 MiB .. 64 GiB, one per power of 2
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
HELP = "e.g. --alloc-conf expandable_segments:True,max_split_size_mb:512"


@dataclass(frozen=True)
class AllocConf:
    """The settings of the CUDA caching allocator that decide reserved bytes (defaults: torch's)."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: unlimited (SIZE_MAX, the default)
    max_non_split_rounding_size: int = KB_LARGE_BUFFER  # AllocatorConfig.h: "The default is 20 MiB"
    large_segment_size: int = KB_LARGE_BUFFER  # AllocatorConfig.h large_segment_size_{20971520}
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    per_process_memory_fraction: float = 1.0
    backend: str = "native"
    text: str = ""  # the string it was parsed from

    def divisions(self, size: int) -> int:
        """AllocatorConfig::roundup_power2_divisions(size): the interval of log2(size), from 1 MiB
        (index 0; smaller sizes too) to 32 GiB and over (index 15)."""
        index = size.bit_length() - 1 - 20  # 63 - clz(size) - log2(1 MiB)
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]


def _tokens(text: str) -> list[str]:
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    return out + ([buf] if buf else [])


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _int(key: str, v: str) -> int:
    if not re.fullmatch(r"\d+", v):
        raise UsageError(f"allocator config {key}:{v}: give a whole number ({HELP})")
    return int(v)


def _bool(key: str, v: str) -> bool:
    if v not in ("True", "False"):
        raise UsageError(f"allocator config {key}:{v}: give True or False (torch takes no other spelling)")
    return v == "True"


def _float(key: str, v: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise UsageError(f"allocator config {key}:{v}: give a number") from None


def _divisions(key: str, toks: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """parseRoundUpPower2Divisions: one power of 2 for every interval, or ``[MB:div,...,>:div]``
    (an interval key is a power of 2 in MiB; the first one also fills the intervals below it; ``>``
    fills the rest)."""
    if toks[i] != "[":
        d = _int(key, toks[i])
        if not _is_pow2(d):
            raise UsageError(f"allocator config {key}:{d}: the divisions must be a power of 2")
        return (d,) * ROUNDUP_INTERVALS, i
    table, first, last = [0] * ROUNDUP_INTERVALS, True, 0
    i += 1
    while i < len(toks) and toks[i] != "]":
        interval = toks[i]
        if i + 2 >= len(toks) or toks[i + 1] != ":":
            raise UsageError(f"allocator config {key}: write [64:8,256:4,>:1] ({HELP})")
        d = _int(key, toks[i + 2])
        if d and not _is_pow2(d):
            raise UsageError(f"allocator config {key}: the divisions {d} must be a power of 2 or 0")
        if interval == ">":
            table[last:] = [d] * (ROUNDUP_INTERVALS - last)
        else:
            mb = _int(key, interval)
            if not _is_pow2(mb):
                raise UsageError(f"allocator config {key}: the interval {mb} must be a power of 2 (MiB)")
            index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                table[:index] = [d] * index
                first = False
            table[index], last = d, index
        i += 3
        if i < len(toks) and toks[i] == ",":
            i += 1
    if i >= len(toks):
        raise UsageError(f"allocator config {key}: a [ without its ] ({HELP})")
    return tuple(table), i


# keys torch accepts that change nothing the model counts (host pinned memory, locking, OOM handling)
_BOOL_KEYS = {"release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
              "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_free_catch_all",
              "throw_on_cudamalloc_oom", "pinned_use_background_threads"}
_SIZE_KEYS = {"pinned_num_register_threads", "pinned_reserve_segment_size_mb"}


# KEY_mb -> (AllocConf field, smallest value torch takes, its rule as torch words it): the parsers
# in c10/core/AllocatorConfig.cpp, parseMaxSplitSize and parseMaxNonSplitRoundingSize (at least
# kLargeBuffer / 1 MiB = 20), parseLargeSegmentSize (more than kMinLargeAlloc / 1 MiB = 10)
_MB_KEYS = {
    "max_split_size_mb": ("max_split_size", KB_LARGE_BUFFER // MiB, ">= 20"),
    "max_non_split_rounding_mb": ("max_non_split_rounding_size", KB_LARGE_BUFFER // MiB, ">= 20"),
    "large_segment_size_mb": ("large_segment_size", K_MIN_LARGE_ALLOC // MiB + 1, "> 10"),
}


def parse(text: str, origin: str = "--alloc-conf") -> AllocConf:
    """AllocConf of a PYTORCH_CUDA_ALLOC_CONF string; a bad key or value is a one-line UsageError."""
    toks = _tokens(text)
    values: dict = {"text": text}
    i = 0
    try:
        while i < len(toks):
            key = toks[i]
            if i + 2 >= len(toks) or toks[i + 1] != ":":
                raise UsageError(f"{origin}: {key!r} has no value: write KEY:VALUE pairs separated by commas ({HELP})")
            i = _read_value(key, toks, i + 2, values, origin) + 1
            if i < len(toks):
                if toks[i] != ",":
                    raise UsageError(f"{origin}: expected ',' after {key}, got {toks[i]!r} ({HELP})")
                i += 1
    except UsageError as e:
        raise UsageError(str(e) if str(e).startswith(origin) else f"{origin}: {e}") from None
    return AllocConf(**values)


def _read_value(key: str, toks: list, i: int, values: dict, origin: str) -> int:
    """KEY's value, toks[i] on, into ``values``; returns the index of the value's last token."""
    v = toks[i]
    if key in _MB_KEYS:
        field, least, rule = _MB_KEYS[key]
        mb = _int(key, v)
        if mb < least:
            raise UsageError(f"{origin}: {key}:{mb} is too small: torch needs {rule}")
        values[field] = mb * MiB
    elif key == "expandable_segments":
        values["expandable_segments"] = _bool(key, v)
    elif key == "garbage_collection_threshold":
        t = _float(key, v)
        if not 0.0 < t < 1.0:
            raise UsageError(f"{origin}: garbage_collection_threshold:{v}: give a number in (0.0, 1.0)")
        values["garbage_collection_threshold"] = t
    elif key == "per_process_memory_fraction":
        f = _float(key, v)
        if not 0.0 <= f <= 1.0:
            raise UsageError(f"{origin}: per_process_memory_fraction:{v}: give a number in [0.0, 1.0]")
        values["per_process_memory_fraction"] = f
    elif key == "roundup_power2_divisions":
        values["roundup_power2_divisions"], i = _divisions(key, toks, i)
    elif key == "backend":
        if v not in ("native", "cudaMallocAsync"):
            raise UsageError(f"{origin}: backend:{v}: torch knows native and cudaMallocAsync")
        values["backend"] = v
    elif key in _BOOL_KEYS:
        _bool(key, v)
    elif key in _SIZE_KEYS:
        _int(key, v)
    else:
        raise UsageError(f"{origin}: unknown key {key!r} (torch's: expandable_segments, max_split_size_mb, "
                         "roundup_power2_divisions, garbage_collection_threshold, max_non_split_rounding_mb, "
                         "large_segment_size_mb, per_process_memory_fraction, backend, ...)")
    return i


def from_environment(explicit: str | None) -> AllocConf:
    """The --alloc-conf string, else the environment's (PYTORCH_CUDA_ALLOC_CONF, then
    PYTORCH_ALLOC_CONF), else torch's defaults."""
    if explicit is not None:
        return parse(explicit)
    for name in ENV_VARS:
        value = os.environ.get(name)
        if value is not None:
            return parse(value, origin=name)
    return AllocConf()
