"""A model of PyTorch's CUDA caching allocator (torch 2.13, the native backend): a sequence of
malloc / free / record_stream / stream-sync events in, allocated and reserved bytes over time out.

Every rule is the one of ``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp (read at
pytorch/pytorch commit 001074d25084fdb87a799823e395a50f5ec044d3; the constants and the
configuration are those of the torch 2.13 wheel's headers, c10/core/AllocatorConfig.h and
c10/cuda/CUDAAllocatorConfig.h, which add ``large_segment_size`` and
``max_non_split_rounding_size`` to the same rules). Each function below names the C++ function it
follows. What is left out: CUDA-graph private pools, ``garbage_collection_threshold`` (it runs
only under a memory fraction), the free-memory callbacks, and the exact order of equal-size free
blocks (torch orders them by address; here addresses grow in allocation order, the same order).

Model of the device: ``capacity`` bytes can be mapped or cudaMalloc'ed by the allocator (the GPU's
memory less what lives outside the allocator: the CUDA context, NCCL's buffers). A new segment
that would pass it fails as cudaMalloc fails, and the allocator frees cached blocks and retries
(``malloc``: ``release_available_cached_blocks`` then ``release_cached_blocks``); if that fails
too the request is an out-of-memory: it is counted in ``oom_events`` and then granted anyway, so
the replay goes on and the peak says by how much the step does not fit.
"""

from __future__ import annotations

import bisect

from fxacct.load.alloc_conf import AllocConf
from fxacct.memory import allocator_rules as rules
from fxacct.memory.allocator_rules import DEFAULT_STREAM, SMALL, Free, Malloc, RecordStream, Replay, Sync


class CachingAllocator:
    """DeviceCachingAllocator's state: free blocks per (pool, stream) ordered by (size, address), the
    segments, and the stats. Feed it events with ``apply``; ``result()`` gives the frozen Replay."""

    def __init__(self, conf: AllocConf | None = None, capacity: int | None = None, keep_timeline: bool = False):
        self.conf = conf or AllocConf()
        cap = capacity if capacity is not None else 1 << 62
        # per_process_memory_fraction: set_fraction, allowed_memory_maximum = fraction x total (alloc_block)
        self.capacity = int(cap * self.conf.per_process_memory_fraction) if self.conf.per_process_memory_fraction < 1 else cap
        self.free: dict[tuple[str, str], list] = {}  # (pool, stream) -> sorted [(size, ptr, block)]
        self.unmapped: dict[tuple[str, str], list] = {}  # expandable: (pool, stream) -> [(ptr, block)]
        self.live: dict[object, rules.Block] = {}
        self.pending: list[rules.Block] = []  # freed while in use on other streams (insert_events)
        self.next_ptr = 0
        self.reserved = self.allocated = self.requested = 0
        self.reserved_by: dict[tuple[str, str], int] = {}
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.peak_by: tuple = ()
        self.peak_event, self.events = -1, 0
        self.segments = self.retries = self.ooms = 0
        self.timeline: list | None = [] if keep_timeline else None

    # -- free-block sets (BlockPool.blocks, ordered by BlockComparatorSize) --------------------------
    def _insert(self, b: rules.Block) -> None:
        bisect.insort(self.free.setdefault((b.pool, b.stream), []), (b.size, b.ptr, id(b), b))

    def _remove(self, b: rules.Block) -> None:
        blocks = self.free[(b.pool, b.stream)]
        i = bisect.bisect_left(blocks, (b.size, b.ptr, id(b)))
        del blocks[i]

    def _address_space(self, size: int) -> int:
        ptr = self.next_ptr
        self.next_ptr += size
        return ptr

    def _grow(self, pool: str, stream: str, nbytes: int) -> None:
        self.reserved += nbytes
        self.reserved_by[(pool, stream)] = self.reserved_by.get((pool, stream), 0) + nbytes

    # -- malloc --------------------------------------------------------------------------------
    def malloc(self, key, orig_size: int, stream: str = DEFAULT_STREAM) -> None:
        """DeviceCachingAllocator::malloc: round, pick the pool, best fit from the cache, else a new
        segment (freeing cached blocks and retrying when the device is full), then split."""
        size = rules.round_size(orig_size, self.conf)
        pool = rules.pool_of(size)
        block = self._get_free_block(size, pool, stream)
        if block is None:
            block = self._alloc_block(size, pool, stream)
            if block is None:  # free enough oversize cached blocks, else every cached one, and retry
                self.retries += 1
                if self._release_available_cached_blocks(size, pool, stream):
                    block = self._alloc_block(size, pool, stream)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(size, pool, stream)
            if block is None:
                self.ooms += 1
                block = self._alloc_block(size, pool, stream, force=True)
        if self._should_split(block, size):
            rest = rules.Block(block.ptr + size, block.size - size, stream, pool, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated, block.requested = True, orig_size
        self.live[key] = block
        self.allocated += block.size
        self.requested += orig_size

    def _get_free_block(self, size: int, pool: str, stream: str) -> rules.Block | None:
        """get_free_block: the smallest cached block of the pool and stream with size >= request;
        under expandable segments a block's size counts the unmapped space after it, and the search
        moves on while the next block's expandable size is smaller; a block >= max_split_size serves
        no request below it, and serves a request above it only within max_non_split_rounding_size
        (20 MiB)."""
        blocks = self.free.get((pool, stream), [])
        i = bisect.bisect_left(blocks, (size,))
        if i == len(blocks):
            return None
        block = blocks[i][3]
        if block.segment is not None and self.conf.expandable_segments:
            def expandable(b):
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(blocks) and expandable(blocks[i + 1][3]) < expandable(block):
                i += 1
                block = blocks[i][3]
        split_limit = self.conf.max_split_size
        if split_limit is not None:
            if size < split_limit and block.size >= split_limit:
                return None
            if size >= split_limit and block.size >= size + self.conf.max_non_split_rounding_size:
                return None
        del blocks[i]
        return block

    def _should_split(self, block: rules.Block, size: int) -> bool:
        """should_split: small pool or expandable segments, a remainder of >= 512 B; large pool,
        a request below max_split_size with a remainder of more than 1 MiB."""
        remaining = block.size - size
        if block.pool == SMALL or self.conf.expandable_segments:
            return remaining >= rules.K_MIN_BLOCK
        limit = self.conf.max_split_size
        return (limit is None or size < limit) and remaining > rules.K_SMALL_SIZE

    def _alloc_block(self, size: int, pool: str, stream: str, force: bool = False) -> rules.Block | None:
        """alloc_block: cudaMalloc of get_allocation_size(size), or under expandable segments
        try_allocate_expandable_block; None where the device has no room for it."""
        if self.conf.expandable_segments:
            return self._allocate_expandable(size, pool, stream, force)
        nbytes = rules.allocation_size(size, self.conf)
        if not force and self.reserved + nbytes > self.capacity:
            return None
        self._grow(pool, stream, nbytes)
        self.segments += 1
        return rules.Block(self._address_space(nbytes), nbytes, stream, pool)

    # -- expandable segments -------------------------------------------------------------------
    def _allocate_expandable(self, size: int, pool: str, stream: str, force: bool) -> rules.Block | None:
        """try_allocate_expandable_block: find_expandable_block (the lowest unmapped range of the
        pool and stream with enough free + unmapped space after it, a free block just before it
        included; else a new segment of 9/8 of the capacity's address space), then map pages
        (map_block: 2 MiB pages in the small pool, large_segment_size = 20 MiB in the large one)
        until the candidate covers the request, merging with its free neighbours."""
        candidate = self._find_expandable_block(size, pool, stream)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), force):
            return None
        while candidate.size < size:
            nxt = candidate.next
            if not self._map_block(nxt, min(size - candidate.size, nxt.size), force):
                return None
            candidate = nxt
        self._remove(candidate)
        return candidate

    def _find_expandable_block(self, size: int, pool: str, stream: str) -> rules.Block:
        def allocatable(b):
            return b is not None and not b.allocated and b.events == 0 and not b.uses

        for _, _, c in self.unmapped.get((pool, stream), []):
            if allocatable(c.prev):
                c = c.prev
            b, room = c, 0
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = rules.K_SMALL_BUFFER if pool == SMALL else self.conf.large_segment_size
        capacity = self.capacity if self.capacity < 1 << 61 else 1 << 50
        pages = -(-(capacity + capacity // 8) // page)  # "address space for 1 1/8 the total memory"
        segment = rules.Expandable(self._address_space(pages * page), page, pages)
        block = rules.Block(segment.base, segment.size, stream, pool, segment, mapped=False)
        bisect.insort(self.unmapped.setdefault((pool, stream), []), (block.ptr, id(block), block))
        return block

    def _unmapped_remove(self, b: rules.Block) -> None:
        lst = self.unmapped[(b.pool, b.stream)]
        del lst[bisect.bisect_left(lst, (b.ptr, id(b)))]

    def _map_block(self, block: rules.Block, size: int, force: bool) -> bool:
        """map_block: map whole pages from the block's start (ExpandableSegment::map rounds the end
        up to a page); the unmapped rest stays a block of its own."""
        seg = block.segment
        start = block.ptr - seg.base
        end = -(-(start + size) // seg.page) * seg.page
        mapped = end - start
        if not force and self.reserved + mapped > self.capacity:
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY
        self._unmapped_remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = rules.Block(block.ptr + mapped, block.size - mapped, block.stream, block.pool, seg, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, mapped
            bisect.insort(self.unmapped[(block.pool, block.stream)], (rest.ptr, id(rest), rest))
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(block)
        self._grow(block.pool, block.stream, mapped)
        self.segments += 1
        return True

    # -- free ----------------------------------------------------------------------------------
    def free_key(self, key) -> None:
        """free: a block used on other streams waits for their events (insert_events), else it
        returns to its pool (free_block)."""
        block = self.live.pop(key)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        if block.uses:
            block.events = len(block.uses)
            self.pending.append(block)
        else:
            self._free_block(block)

    def record_stream(self, key, stream: str) -> None:
        """recordStream: uses on the allocation stream itself are ignored."""
        block = self.live[key]
        if stream != block.stream:
            block.uses.add(stream)

    def sync(self, stream: str) -> None:
        """process_events: a completed event on ``stream`` releases its blocks once none is left."""
        still = []
        for block in self.pending:
            if stream in block.uses:
                block.uses.discard(stream)
                block.events -= 1
            if block.events == 0:
                block.uses.clear()
                self._free_block(block)
            else:
                still.append(block)
        self.pending = still

    def _free_block(self, block: rules.Block) -> None:
        """free_block: merge with free neighbours of the same segment, back into the pool."""
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(block)

    def _merge(self, dst: rules.Block, src: rules.Block | None) -> None:
        """try_merge_blocks: only a free, event-free neighbour in the same mapped state."""
        if src is None or src.allocated or src.events or src.uses or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove(src)
        else:
            self._unmapped_remove(src)
        if dst.prev is src:
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # -- giving memory back --------------------------------------------------------------------
    def _release_block(self, block: rules.Block) -> None:
        """release_block: cudaFree of a whole cached segment."""
        self._remove(block)
        self.reserved -= block.size
        self.reserved_by[(block.pool, block.stream)] -= block.size

    def _release_available_cached_blocks(self, size: int, pool: str, stream: str) -> bool:
        """release_available_cached_blocks (only with max_split_size set): free the smallest
        oversize cached block >= max(size, max_split_size), or else oversize blocks from the
        largest down until that much is freed."""
        limit = self.conf.max_split_size
        if limit is None:
            return False
        want = max(size, limit)
        blocks = [e[3] for e in self.free.get((pool, stream), []) if e[3].segment is None and not e[3].is_split()]
        fitting = [b for b in blocks if b.size >= want]
        if fitting:
            self._release_block(fitting[0])
            return True
        released = 0
        for b in reversed(blocks):
            if released >= want or b.size < limit:
                break
            released += b.size
            self._release_block(b)
        return released >= want

    def _release_cached_blocks(self) -> bool:
        """release_cached_blocks: wait for every pending event (synchronize_and_free_events), then
        cudaFree every cached block that is a whole segment, and under expandable segments unmap
        every whole free page (release_blocks, unmap_block)."""
        for block in self.pending:
            block.uses.clear()
            block.events = 0
            self._free_block(block)
        self.pending = []
        for blocks in self.free.values():
            for _, _, _, b in list(blocks):
                if b.segment is not None:
                    self._unmap_block(b)
                elif not b.is_split():
                    self._release_block(b)
        return True

    def _unmap_block(self, block: rules.Block) -> None:
        """unmap_block: the whole pages inside a free block go back; the partial pages at either end
        stay mapped as free blocks of their own."""
        seg = block.segment
        start, end = block.ptr - seg.base, block.ptr - seg.base + block.size
        first = -(-start // seg.page) * seg.page
        last = end // seg.page * seg.page
        if first >= last:
            return
        self._remove(block)
        pieces = [(start, first, True), (first, last, False), (last, end, True)]
        prev, nxt = block.prev, block.next
        made = []
        for lo, hi, mapped in pieces:
            if hi > lo:
                b = rules.Block(seg.base + lo, hi - lo, block.stream, block.pool, seg, mapped=mapped)
                made.append(b)
        for a, b in zip(made, made[1:]):
            a.next, b.prev = b, a
        made[0].prev, made[-1].next = prev, nxt
        if prev is not None:
            prev.next = made[0]
        if nxt is not None:
            nxt.prev = made[-1]
        for b in made:
            if b.mapped:
                self._insert(b)
        hole = next(b for b in made if not b.mapped)
        self._merge(hole, hole.prev)
        self._merge(hole, hole.next)
        bisect.insort(self.unmapped.setdefault((block.pool, block.stream), []), (hole.ptr, id(hole), hole))
        self.reserved -= last - first
        self.reserved_by[(block.pool, block.stream)] -= last - first

    # -- driving -------------------------------------------------------------------------------
    def apply(self, event) -> None:
        if isinstance(event, Malloc):
            self.malloc(event.key, event.size, event.stream)
        elif isinstance(event, Free):
            self.free_key(event.key)
        elif isinstance(event, RecordStream):
            self.record_stream(event.key, event.stream)
        elif isinstance(event, Sync):
            self.sync(event.stream)
        else:
            raise TypeError(f"not an allocator event: {event!r}")
        self._observe()

    def _observe(self) -> None:
        if self.reserved > self.peak_reserved:
            self.peak_reserved, self.peak_event = self.reserved, self.events
            self.peak_by = tuple((p, s, b) for (p, s), b in sorted(self.reserved_by.items()) if b)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        if self.timeline is not None:
            self.timeline.append((self.allocated, self.reserved))
        self.events += 1

    def result(self) -> Replay:
        return Replay(self.peak_reserved, self.peak_allocated, self.peak_requested, self.peak_by, self.peak_event,
                      self.segments, self.retries, self.ooms, tuple(self.timeline or ()))


def replay(events, conf: AllocConf | None = None, capacity: int | None = None, timeline: bool = False) -> Replay:
    """Run ``events`` (Malloc, Free, RecordStream, Sync) through a fresh allocator."""
    allocator = CachingAllocator(conf, capacity, timeline)
    for event in events:
        allocator.apply(event)
    return allocator.result()
