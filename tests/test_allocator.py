"""The caching-allocator model (fxacct.memory.allocator) walked through each rule of torch 2.13's
c10/cuda/CUDACachingAllocator.cpp with hand-written sequences; every expected figure is derived
in the comment above it from the constants and functions named there (kMinBlockSize = 512 B,
kSmallSize = 1 MiB, kSmallBuffer = 2 MiB, kLargeBuffer = large_segment_size = 20 MiB,
kMinLargeAlloc = 10 MiB, kRoundLarge = 2 MiB)."""

import pytest

from fxacct.errors import UsageError
from fxacct.load.alloc_conf import AllocConf, from_environment, parse
from fxacct.memory.allocator import CachingAllocator, replay
from fxacct.memory.allocator_rules import Free, Malloc, RecordStream, Sync, round_size

KiB, MiB = 2**10, 2**20
EXPANDABLE = parse("expandable_segments:True")


def test_round_size_minimum_and_512_multiples():
    # round_size: below kMinBlockSize -> 512; else the next multiple of 512
    assert round_size(1, AllocConf()) == 512
    assert round_size(512, AllocConf()) == 512
    assert round_size(513, AllocConf()) == 1024
    assert round_size(10 * MiB + 1, AllocConf()) == 10 * MiB + 512


def test_round_size_power2_divisions():
    # roundup_power2_next_division(1200 KiB, 4): between 1024 KiB and 2048 KiB in 4 steps of 256 KiB
    # -> 1280 KiB (the source's own example, in KiB); a power of 2 stays as it is
    conf = parse("roundup_power2_divisions:4")
    assert round_size(1200 * KiB, conf) == 1280 * KiB
    assert round_size(2 * MiB, conf) == 2 * MiB
    # size must exceed 512 x divisions for the rule to apply: 1500 B with 4 divisions -> 1536 (512 multiple)
    assert round_size(1500, conf) == 1536
    # the list form: [64:8,>:1] gives intervals below 64 MiB 8 divisions, 64 MiB and up 1 (off)
    listed = parse("roundup_power2_divisions:[64:8,>:1]")
    assert round_size(33 * MiB, listed) == 36 * MiB  # 32 MiB + one step of 32/8 = 4 MiB
    assert round_size(65 * MiB, listed) == 65 * MiB  # divisions 1: plain 512 multiple


def test_rounding_reaches_the_pool_and_reserved():
    # 1200 KiB with 4 divisions rounds to 1280 KiB > kSmallSize: large pool; < kMinLargeAlloc, so a
    # kLargeBuffer (20 MiB) segment; allocated is the rounded block (remainder 18.75 MiB > 1 MiB: split)
    r = replay([Malloc("a", 1200 * KiB)], parse("roundup_power2_divisions:4"))
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes, r.peak_requested_bytes) == (20 * MiB, 1280 * KiB, 1200 * KiB)
    assert r.reserved_at_peak == (("large", "default", 20 * MiB),)


@pytest.mark.parametrize("size,reserved,pool", [
    (1 * MiB, 2 * MiB, "small"),  # <= kSmallSize: small pool, a kSmallBuffer segment
    (1 * MiB + 1, 20 * MiB, "large"),  # rounds to 1 MiB + 512 > kSmallSize: large, < 10 MiB: kLargeBuffer
    (10 * MiB - 512, 20 * MiB, "large"),  # still < kMinLargeAlloc
    (10 * MiB, 10 * MiB, "large"),  # >= kMinLargeAlloc: rounded up to kRoundLarge (already a multiple)
    (11 * MiB + 1, 12 * MiB, "large"),  # 11 MiB + 512 rounded up to 2 MiB
])
def test_pool_and_segment_size(size, reserved, pool):
    r = replay([Malloc("a", size)])
    assert r.peak_reserved_bytes == reserved
    assert r.reserved_at_peak == ((pool, "default", reserved),)


def test_small_pool_packs_a_2mib_segment():
    # four 512 KiB requests share one 2 MiB segment (small pool: split while >= 512 B remains);
    # the fifth needs a second segment
    events = [Malloc(i, 512 * KiB) for i in range(5)]
    assert replay(events[:4]).peak_reserved_bytes == 2 * MiB
    assert replay(events).peak_reserved_bytes == 4 * MiB


def test_split_large_block_when_more_than_1mib_remains():
    # 3 MiB: a 20 MiB segment split into 3 + 17 (remainder > kSmallSize); the second 3 MiB takes
    # the cached 17 MiB remainder (best fit), so reserved stays 20 MiB
    r = replay([Malloc("a", 3 * MiB), Malloc("b", 3 * MiB)])
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes, r.segments_allocated) == (20 * MiB, 6 * MiB, 1)


def test_no_split_when_1mib_or_less_remains():
    # 19 MiB >= kMinLargeAlloc: a segment of 20 MiB (rounded to 2 MiB); remainder 1 MiB is not > kSmallSize,
    # so the whole 20 MiB block is allocated, and a later 1.5 MiB request needs its own 20 MiB segment
    r = replay([Malloc("a", 19 * MiB), Malloc("b", 3 * MiB // 2)])
    assert r.peak_allocated_bytes == 20 * MiB + 3 * MiB // 2  # the whole 20 MiB block + 1.5 MiB (split off)
    assert r.peak_reserved_bytes == 40 * MiB


def test_freed_block_is_reused_best_fit():
    # free 30 MiB and 12 MiB blocks cached; a 10 MiB request takes the smallest that fits (12 MiB,
    # split? remainder 2 MiB > 1 MiB: yes), so reserved stays 42 MiB
    r = replay([Malloc("a", 30 * MiB), Malloc("b", 12 * MiB), Free("a"), Free("b"), Malloc("c", 10 * MiB),
                Malloc("d", 28 * MiB)])
    # d (28 MiB) then fits in the 30 MiB block: still 42 MiB
    assert r.peak_reserved_bytes == 42 * MiB


def test_max_split_size_keeps_oversize_blocks_whole():
    conf = parse("max_split_size_mb:20")
    # get_free_block: a request below max_split_size never takes a block >= max_split_size:
    # the cached 30 MiB block is skipped and 12 MiB gets a segment of its own -> 42 MiB
    assert replay([Malloc("a", 30 * MiB), Free("a"), Malloc("b", 12 * MiB)], conf).peak_reserved_bytes == 42 * MiB
    # without the limit the 30 MiB block is split (remainder 18 MiB > 1 MiB) -> 30 MiB
    assert replay([Malloc("a", 30 * MiB), Free("a"), Malloc("b", 12 * MiB)]).peak_reserved_bytes == 30 * MiB
    # a request >= max_split_size takes an oversize block only within max_non_split_rounding (20 MiB):
    # 25 MiB in the cached 30 MiB block (30 < 25 + 20), whole (no split above the limit): allocated 30 MiB
    r = replay([Malloc("a", 30 * MiB), Free("a"), Malloc("b", 25 * MiB)], conf)
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (30 * MiB, 30 * MiB)
    # 30 MiB does not take a cached 60 MiB block (60 >= 30 + 20): a new 30 MiB segment -> 90 MiB
    assert replay([Malloc("a", 60 * MiB), Free("a"), Malloc("b", 30 * MiB)], conf).peak_reserved_bytes == 90 * MiB


def test_one_pool_per_stream():
    # a block freed on stream s1 serves only s1: the default stream's 30 MiB request needs a new segment
    r = replay([Malloc("a", 30 * MiB, "s1"), Free("a"), Malloc("b", 30 * MiB)])
    assert r.peak_reserved_bytes == 60 * MiB
    assert r.reserved_at_peak == (("large", "default", 30 * MiB), ("large", "s1", 30 * MiB))
    # the same on one stream reuses it
    assert replay([Malloc("a", 30 * MiB), Free("a"), Malloc("b", 30 * MiB)]).peak_reserved_bytes == 30 * MiB


def test_cross_stream_free_waits_for_the_other_stream():
    # record_stream(x, s1) then free: the block waits for s1's event (insert_events); a request
    # before s1 is done gets a new segment (60 MiB); after Sync(s1) the block is back: no third one
    events = [Malloc("x", 30 * MiB), RecordStream("x", "s1"), Free("x"), Malloc("y", 30 * MiB), Free("y"),
              Sync("s1"), Malloc("z", 30 * MiB), Malloc("w", 30 * MiB)]
    r = replay(events)
    assert r.peak_reserved_bytes == 60 * MiB
    # without the record_stream, y reuses x's block: a single 30 MiB segment until w
    plain = replay([e for e in events if not isinstance(e, RecordStream)][:5])
    assert plain.peak_reserved_bytes == 30 * MiB
    # a record_stream on the allocation stream itself is ignored (recordStream)
    same = replay([Malloc("x", 30 * MiB), RecordStream("x", "default"), Free("x"), Malloc("y", 30 * MiB)])
    assert same.peak_reserved_bytes == 30 * MiB


def test_expandable_segments_grow_page_by_page():
    # large pool pages are large_segment_size = 20 MiB: 3 MiB maps one page (20 MiB reserved); 30 MiB then
    # extends the same segment from the free 17 MiB tail: 13 MiB more -> one more page: 40 MiB, where
    # separate segments would reserve 20 + 30 = 50 MiB
    events = [Malloc("a", 3 * MiB), Malloc("b", 30 * MiB)]
    assert replay(events, EXPANDABLE).peak_reserved_bytes == 40 * MiB
    assert replay(events).peak_reserved_bytes == 50 * MiB
    # small pool pages are 2 MiB: three 1 MiB requests map two pages
    assert replay([Malloc(i, MiB) for i in range(3)], EXPANDABLE).peak_reserved_bytes == 4 * MiB
    # a 50 MiB request maps ceil(50 / 20) = 3 pages; its 10 MiB tail serves a later 8 MiB request
    r = replay([Malloc("a", 50 * MiB), Malloc("b", 8 * MiB)], EXPANDABLE)
    assert (r.peak_reserved_bytes, r.segments_allocated) == (60 * MiB, 1)
    # pages are mapped per stream (one segment per stream and pool)
    assert replay([Malloc("a", 3 * MiB), Malloc("b", 3 * MiB, "s1")], EXPANDABLE).peak_reserved_bytes == 40 * MiB


def test_capacity_full_releases_cached_blocks_and_retries():
    # capacity 50 MiB: a cached (freed) 30 MiB segment and a 40 MiB request: cudaMalloc would pass the
    # capacity, so release_cached_blocks frees the cached segment and the retry succeeds: reserved
    # never exceeds 50 MiB, peak 40 MiB
    a = CachingAllocator(capacity=50 * MiB)
    for e in [Malloc("a", 30 * MiB), Free("a"), Malloc("b", 40 * MiB)]:
        a.apply(e)
    r = a.result()
    assert (r.peak_reserved_bytes, r.alloc_retries, r.oom_events) == (40 * MiB, 1, 0)
    # without the capacity the cache is kept: 70 MiB
    assert replay([Malloc("a", 30 * MiB), Free("a"), Malloc("b", 40 * MiB)]).peak_reserved_bytes == 70 * MiB
    # nothing cached to free: an out-of-memory (granted so the replay goes on, and counted)
    r = replay([Malloc("a", 30 * MiB), Malloc("b", 30 * MiB)], capacity=50 * MiB)
    assert (r.peak_reserved_bytes, r.oom_events) == (60 * MiB, 1)


def test_capacity_full_unmaps_free_pages_of_expandable_segments():
    # expandable, capacity 60 MiB: 30 MiB on s1 maps 2 pages (40 MiB); freed, it stays mapped. The default
    # stream's 30 MiB needs 40 MiB more: 80 > 60, so release_cached_blocks unmaps s1's free pages and
    # the default stream maps its own: peak 40 MiB
    r = replay([Malloc("a", 30 * MiB, "s1"), Free("a"), Malloc("b", 30 * MiB)], EXPANDABLE, capacity=60 * MiB)
    assert (r.peak_reserved_bytes, r.oom_events, r.reserved_at_peak) == (40 * MiB, 0, (("large", "s1", 40 * MiB),))


def test_max_split_size_releases_oversize_blocks_first():
    # max_split_size_mb:20, capacity 100 MiB: 20 MiB held, an oversize 60 MiB block cached (reserved 80 MiB).
    # 30 MiB may not take it (60 >= 30 + max_non_split_rounding 20); cudaMalloc of 30 MiB fails (80 + 30 > 100);
    # release_available_cached_blocks frees the smallest cached block >= max(30, 20) MiB, the 60 MiB one, and
    # the retry succeeds: reserved 20 + 30 = 50 MiB; the peak stays the 80 MiB before it
    r = replay([Malloc("h", 20 * MiB), Malloc("a", 60 * MiB), Free("a"), Malloc("b", 30 * MiB)],
               parse("max_split_size_mb:20"), capacity=100 * MiB)
    assert (r.peak_reserved_bytes, r.alloc_retries, r.oom_events) == (80 * MiB, 1, 0)


def test_timeline_is_allocated_and_reserved_after_each_event():
    r = replay([Malloc("a", 100), Free("a")], timeline=True)
    assert r.timeline == ((512, 2 * MiB), (0, 2 * MiB))


@pytest.mark.parametrize("text", ["expandable_segments:true", "max_split_size_mb:10", "max_split_size_mb:x",
                                  "roundup_power2_divisions:3", "bogus_key:1", "expandable_segments",
                                  "garbage_collection_threshold:1.5", "large_segment_size_mb:10",
                                  "roundup_power2_divisions:[64:8", "backend:foo"])
def test_bad_alloc_conf_is_a_usage_error(text):
    with pytest.raises(UsageError, match="--alloc-conf"):
        parse(text)


def test_valid_torch_keys_accepted():
    conf = parse("expandable_segments:True, release_lock_on_cudamalloc:False,pinned_num_register_threads:8,"
                 "garbage_collection_threshold:0.6,max_non_split_rounding_mb:40,per_process_memory_fraction:0.5")
    assert conf.expandable_segments and conf.max_non_split_rounding_size == 40 * MiB
    assert conf.per_process_memory_fraction == 0.5


def test_environment_is_read(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert from_environment(None).expandable_segments
    assert not from_environment("expandable_segments:False").expandable_segments  # the flag wins
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "nonsense:1")
    with pytest.raises(UsageError, match="PYTORCH_CUDA_ALLOC_CONF"):
        from_environment(None)
