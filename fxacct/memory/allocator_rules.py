"""The caching allocator's fixed rules and its inputs and output: the size constants, rounding, the
pool and the segment size of a request, the events a replay takes and the Replay it gives
(c10/cuda/CUDACachingAllocator.cpp and c10/core/AllocatorConfig.h of torch 2.13; the engine that
applies them: fxacct.memory.allocator)."""

from __future__ import annotations

from dataclasses import dataclass

from fxacct.load.alloc_conf import AllocConf

MiB = 2**20
K_MIN_BLOCK = 512  # kMinBlockSize, c10/core/AllocatorConfig.h: "all sizes are rounded to at least 512 bytes"
K_SMALL_SIZE = MiB  # kSmallSize: "largest 'small' allocation is 1 MiB"
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: "'small' allocations are packed in 2 MiB blocks"
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: "allocations between 1 and 10 MiB may use kLargeBuffer"
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: "round up large allocations to 2 MiB"
SMALL, LARGE = "small", "large"
DEFAULT_STREAM = "default"


@dataclass(frozen=True)
class Malloc:
    key: object  # names the allocation for its free
    size: int  # bytes requested
    stream: str = DEFAULT_STREAM


@dataclass(frozen=True)
class Free:
    key: object


@dataclass(frozen=True)
class RecordStream:
    """``tensor.record_stream(s)``: the block is used on ``stream`` too (recordStream)."""

    key: object
    stream: str


@dataclass(frozen=True)
class Sync:
    """The work queued on ``stream`` so far has completed: the events of blocks freed while in use
    there are done (process_events frees them at the next malloc)."""

    stream: str


@dataclass(frozen=True)
class Replay:
    peak_reserved_bytes: int
    peak_allocated_bytes: int  # block bytes (rounded sizes), torch's allocated_bytes
    peak_requested_bytes: int  # bytes asked for, torch's requested_bytes
    reserved_at_peak: tuple[tuple[str, str, int], ...]  # (pool, stream, bytes) when reserved peaked
    peak_event: int  # index of the event after which reserved first reached its peak (-1: none)
    segments_allocated: int  # cudaMalloc calls, or page mappings under expandable segments
    alloc_retries: int  # mallocs that had to free cached blocks first
    oom_events: int  # mallocs that failed even then (granted anyway)
    timeline: tuple[tuple[int, int], ...] = ()  # (allocated, reserved) after each event


def round_size(size: int, conf: AllocConf) -> int:
    """DeviceCachingAllocator::round_size: at least 512 B; a multiple of 512 B, or, with
    roundup_power2_divisions for the size's power-of-2 interval, the next of that many equal steps
    between two powers of 2 (roundup_power2_next_division)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    divisions = conf.divisions(size)
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)  # power2_floor >> log2(divisions)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return K_MIN_BLOCK * -(-size // K_MIN_BLOCK)


def pool_of(size: int) -> str:
    """get_pool: rounded sizes up to kSmallSize (1 MiB) go to the small pool."""
    return SMALL if size <= K_SMALL_SIZE else LARGE


def allocation_size(size: int, conf: AllocConf) -> int:
    """get_allocation_size: the segment cudaMalloc'ed for a rounded request no cached block serves:
    2 MiB for the small pool, large_segment_size (20 MiB) below kMinLargeAlloc (10 MiB), else the
    request rounded up to 2 MiB."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return conf.large_segment_size
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


class Block:
    """A Block of CUDACachingAllocator.cpp: an address range of a segment, free or allocated."""

    __slots__ = ("ptr", "size", "stream", "pool", "allocated", "mapped", "prev", "next", "segment", "uses",
                 "events", "requested")

    def __init__(self, ptr, size, stream, pool, segment=None, mapped=True):
        self.ptr, self.size, self.stream, self.pool = ptr, size, stream, pool
        self.allocated, self.mapped, self.prev, self.next = False, mapped, None, None
        self.segment, self.uses, self.events, self.requested = segment, set(), 0, 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Expandable:
    """ExpandableSegment: one address range per (pool, stream) whose pages are mapped on demand."""

    def __init__(self, base: int, page: int, pages: int):
        self.base, self.page, self.size = base, page, page * pages
