"""Two points of one capped replay (reserved.py `replay_capped`) compared by where the allocator placed
its blocks: under a limit segments go back to the driver and new ones take new addresses, so a
`CachingAllocator.layout` there is compared by position, not address."""

from __future__ import annotations

from bisect import bisect_right


def same_places(before: tuple, now: tuple) -> bool:
    """Whether two layouts of one replay under a limit (`CachingAllocator.layout`, no pending frees) play
    the rest of a step alike. Segments go back to the driver and new ones take new addresses, so they
    compare by position: each segment's stream, pool and size in address order, each free block's size,
    segment (its index) and offset in it, in its pool's order, and each live buffer's block likewise; best
    fit reads addresses only through their order, which those give. The persistent blocks, never freed,
    fill the rest of the segments that hold them, which no release returns: the same segments, at the same
    positions in both. Where no segment came or went between them, positions are the addresses."""
    (held, segments, sizes, pools), live = before
    (held_now, segments_now, sizes_now, pools_now), live_now = now
    if (held != held_now or len(segments) != len(segments_now) or len(live) != len(live_now)
            or pools.keys() != pools_now.keys() or any(len(pools[k]) != len(pools_now[k]) for k in pools)):
        return False
    if segments == segments_now:  # the same segments (by identity), at the same addresses
        return sizes == sizes_now and live == live_now and all(
            [entry[:2] for entry in pools[k]] == [entry[:2] for entry in pools_now[k]] for k in pools)
    if ([(seg.stream, seg.small) for seg in segments] != [(seg.stream, seg.small) for seg in segments_now]
            or (sizes or [seg.size for seg in segments]) != (sizes_now or [seg.size for seg in segments_now])):
        return False
    return _positions(segments, pools, live) == _positions(segments_now, pools_now, live_now)


def _positions(segments: list, pools: dict, live: list) -> tuple:
    """A layout's free blocks (by pool) and live blocks with each address as (segment index, offset)."""
    starts = [seg.address for seg in segments]

    def at(address: int) -> tuple[int, int]:
        i = bisect_right(starts, address) - 1
        return i, address - starts[i]

    return ({key: [(size, *at(address)) for size, address, _ in pool] for key, pool in pools.items()},
            [(*at(address), size) for address, size in live])
