"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.13), so that
reserved memory is a prediction rather than a bound.

Reserved memory is what the allocator holds from the driver: segments it cudaMalloc'd (or, with
expandable segments, pages it mapped), never returned during a step. What it holds beyond the live
tensors is cached blocks that the next request cannot use: a block sits in its stream's pool, a freed
block splits and merges only inside its own segment, and a request takes the smallest free block that
fits (best fit), so allocation order decides how much more is needed. This module replays a sequence of
requests and frees through those rules; it knows nothing of FSDP and has no clock of its own: a free
that waits for a stream (`Tensor.record_stream`) is given the time its event completes, a request the
time its CPU issues it.

Rules, each as the source states it (names are the source's):
- `round_size`: requests are rounded up to a multiple of kMinBlockSize (512 B);
- `get_pool`: <= kSmallSize (1 MiB) the small pool, else the large pool; one of each per stream
  (`BlockComparatorSize` orders by stream first: a block is reused only by a request on its stream);
- `get_free_block`: the smallest cached block >= the request on that stream (ties: lowest address);
  with `max_split_size` a request under it takes no block at or over it, and a request at or over it
  takes no block kLargeBuffer (20 MiB) larger than itself;
- `get_allocation_size`: a new segment is kSmallBuffer (2 MiB) for a small request, kLargeBuffer
  (20 MiB) for one under kMinLargeAlloc (10 MiB), else the request rounded up to kRoundLarge (2 MiB);
- `should_split`: the rest of a block is split off when it is >= kMinBlockSize (small pool, or any pool
  with expandable segments), or > kSmallSize for a large request under `max_split_size`;
- `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of its segment; a block
  with stream uses (`record_stream`) returns to its pool only when `process_events` (run at the start of
  every `malloc`) finds the events recorded at the free complete;
- expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`): one growing segment per
  stream and pool whose pages are kSmallBuffer (small pool) or kLargeBuffer (large pool)
  (`get_expandable_segment`: `segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer`); a request
  no block fits maps pages at the segment's end, joining the free block there (`try_allocate_expandable_block`);
- `release_cached_blocks` (`torch.cuda.empty_cache`): frees every segment with nothing allocated in it
  (expandable: unmaps the whole pages of free blocks); `releasable` reports what it would return;
- `malloc` when `alloc_block` (cudaMalloc) fails, here when reserved would pass `limit`:
  `release_available_cached_blocks` (only with `max_split_size`: cached whole segments at or over it, the
  smallest that covers the request, else the largest down) and `alloc_block` again; then
  `release_cached_blocks` and `alloc_block(params, true)`, which counts `num_alloc_retries`; then
  OutOfMemoryError.
"""

from __future__ import annotations

import bisect
import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass

from fsdp_sim.datafile import get_key, reject_unknown_keys
from fsdp_sim.engine.blocks import Block, Segment, absorb
from fsdp_sim.errors import ScenarioError

MIN_BLOCK = 512  # kMinBlockSize: "all sizes are rounded to at least 512 bytes"
SMALL_SIZE = 1 << 20  # kSmallSize: "largest 'small' allocation is 1 MiB"
SMALL_BUFFER = 2 << 20  # kSmallBuffer: "'small' allocations are packed in 2 MiB blocks"
LARGE_BUFFER = 20 << 20  # kLargeBuffer: "'large' allocations may be packed in 20 MiB blocks"
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: "allocations between 1 and 10 MiB may use kLargeBuffer"
ROUND_LARGE = 2 << 20  # kRoundLarge: "round up large allocations to 2 MiB"


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """`PYTORCH_CUDA_ALLOC_CONF` options that move reserved memory; PyTorch's defaults."""

    expandable_segments: bool = False  # CUDAAllocatorConfig: expandable_segments off by default
    max_split_size: int | None = None  # bytes; None: unlimited (CUDAAllocatorConfig's SIZE_MAX)


MAX_SPLIT_MB = 1 << 30  # a stated limit (1 PiB in MiB), so the byte count stays exact


def allocator_config(section: dict) -> AllocatorConfig:
    """The scenario's `allocator` section: `PYTORCH_CUDA_ALLOC_CONF`'s options under their own names."""
    reject_unknown_keys("allocator", section, {"expandable_segments", "max_split_size_mb"})
    expandable = get_key("allocator", section, "expandable_segments", bool, False)
    split = get_key("allocator", section, "max_split_size_mb", int, None, positive=True, maximum=MAX_SPLIT_MB)
    if split is not None and split <= LARGE_BUFFER >> 20:  # CUDAAllocatorConfig: "max_split_size_mb too small, must be > 20"
        raise ScenarioError(f"allocator.max_split_size_mb: must be > {LARGE_BUFFER >> 20} (PyTorch refuses smaller), got {split}")
    return AllocatorConfig(expandable, None if split is None else split << 20)


def round_size(nbytes: int) -> int:
    """`round_size`: the block size a request occupies (multiples of 512 B, at least 512 B)."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def pool_key(stream: str, size: int) -> tuple[str, bool]:
    """`get_pool`: the stream's small pool for a rounded request <= kSmallSize, else its large pool."""
    return stream, size <= SMALL_SIZE


def segment_size(size: int) -> int:
    """`get_allocation_size`: the cudaMalloc size for a rounded request that no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class OutOfMemory(Exception):
    """`OutOfMemoryError`: no cached block fits and the driver cannot give the memory, even after `malloc`
    returned the cache's free segments and retried."""


class CachingAllocator:
    """The allocator's pools and segments. With no `limit` the driver never refuses, so `reserved` only
    grows (nothing calls empty_cache in a step); with one, a request the driver cannot serve releases
    cached segments and retries as `malloc` does (`retries` counts `num_alloc_retries`).

    Pools are sorted lists of (size, address, block) per (stream, small), so best fit is a bisection (the
    address breaks ties, blocks are never compared); a step of n requests costs O(n log n) comparisons
    plus the list moves of the few free blocks a pool holds.
    """

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), segment_align: int = ROUND_LARGE,
                 limit: int | None = None) -> None:
        self.config = config
        self.segment_align = segment_align  # fictional device addresses: segments never overlap
        self.limit = limit  # bytes the driver can give the allocator (None: as much as asked)
        self.segments: list[Segment] = []
        self.reserved = 0
        self.peak = 0  # `max_memory_reserved`
        self.retries = 0  # `num_alloc_retries`: requests that released the cache and asked the driver again
        self._pools: dict[tuple[str, bool], list[tuple[int, int, Block]]] = {}
        self._expandable: dict[tuple[str, bool], Segment] = {}
        self._waiting: list[tuple[float, int, Block]] = []  # heap of (events complete at, order, block)
        self.next_address = segment_align
        self._plain = config.max_split_size is None and not config.expandable_segments
        self._split_any = config.expandable_segments  # every rest >= kMinBlockSize is split off
        self._split_below = config.max_split_size or 1 << 62  # large requests at or over it take whole blocks

    # ---- requests --------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: str, now: float = 0.0) -> Block:
        """A request of `nbytes` on `stream`, issued by the CPU at `now` (for `process_events`)."""
        size = round_size(nbytes)
        return self.serve(size, pool_key(stream, size), nbytes, now)

    def serve(self, size: int, key: tuple[str, bool], nbytes: int, now: float) -> Block:
        """`malloc` once `round_size` and `get_pool` have given `size` and `key`: a one-event `play`."""
        blocks: dict = {}
        self.play(((None, nbytes, size, key, now, None),), 0.0, blocks)
        return blocks[None]

    def free(self, block: Block, ready_at: float | None = None) -> None:
        """Free `block`; with `ready_at` (a recorded stream's event completes then) it returns to its pool
        only at the first `malloc` issued at or after that time (`insert_events` / `process_events`)."""
        self.play(((None, 0, 0, None, 0.0, ready_at),), 0.0, {None: block})

    def play(self, events, offset: float, blocks: dict, log: list | None = None) -> None:
        """Requests and frees in order, each (buffer, bytes asked, rounded bytes (0: a free), pool, issued,
        ready) with `round_size` and `get_pool` worked out (a replay does it once for every step), the
        times shifted by `offset`; `blocks` holds each live buffer's block; `log` gets reserved after each
        event. One loop with its names bound locally, as a replay plays thousands of events a step.

        A request: `process_events`, best fit in its pool (else `alloc_block`), `should_split` (any rest
        of >= kMinBlockSize in the small pool or with expandable segments; in the large pool a rest >
        kSmallSize of a request under max_split_size). A free: back to its pool now, or once the event of
        the stream it was recorded on (`ready`) completes."""
        waiting, pools, plain, release = self._waiting, self._pools, self._plain, self._release
        split_any, split_below = self._split_any, self._split_below
        heappop, new = heapq.heappop, object.__new__
        for buf, nbytes, size, key, now, ready in events:
            if size:
                if waiting:  # process_events
                    now += offset
                    while waiting and waiting[0][0] <= now:
                        release(heappop(waiting)[2])
                pool = pools.get(key)
                if pool is None:
                    pool = pools[key] = []
                if plain:  # best fit is the first block >= size (no max_split_size, no expandable end block)
                    i = bisect_left(pool, (size,))
                    block = self._alloc_block(key, size) if i == len(pool) else pool.pop(i)[2]
                else:
                    i = self._best_fit(pool, size)
                    block = self._alloc_block(key, size) if i < 0 else pool.pop(i)[2]
                rest = block.size - size
                if rest >= MIN_BLOCK and (key[1] or split_any or (rest > SMALL_SIZE and size < split_below)):
                    nxt = block.next
                    tail = new(Block)  # its fields stored here, not by Block.__init__ (half the time; a split a request)
                    tail.address, tail.size, tail.segment, tail.prev, tail.next, tail.state = (
                        block.address + size, rest, block.segment, block, nxt, "free")
                    if nxt is not None:
                        nxt.prev = tail
                    elif block.segment.last is block:
                        block.segment.last = tail
                    block.next, block.size = tail, size
                    insort(pool, (rest, tail.address, tail))
                block.state = "allocated"
                blocks[buf] = block
            else:
                block = blocks.pop(buf)
                if block.state != "allocated":
                    raise ValueError(f"block at {block.address:#x} freed while {block.state}")
                if ready is None:
                    release(block)
                else:
                    block.state = "waiting"
                    heapq.heappush(waiting, (ready + offset, block.address, block))
            if log is not None:
                log.append(self.reserved)

    def restore(self, segments, allocated, next_address: int) -> None:
        """Make this new allocator hold `segments` ((address, size, pool), ascending) with the
        blocks `allocated` ((address, size), ascending, each inside one) in use and every other range free,
        one block per gap since free neighbours always merge: the state a replay with no pending frees and
        no expandable segments is in whenever only those blocks are live (reserved.py `Restart`)."""
        held = iter(allocated)
        taken = next(held, None)
        for address, size, (stream, small) in segments:
            seg = Segment(address, size, stream, small, False, self._pools.setdefault((stream, small), []))
            self.segments.append(seg)
            self.reserved += size
            at, end, prev = address, address + size, None
            while at < end:
                if taken is not None and taken[0] == at:
                    block = Block(at, taken[1], seg, prev, None)
                    block.state = "allocated"
                    taken = next(held, None)
                else:
                    block = Block(at, (taken[0] if taken is not None and taken[0] < end else end) - at, seg, prev, None)
                    self._put(seg.pool, block)
                if prev is not None:
                    prev.next = block
                prev, at = block, at + block.size
            seg.last = prev
        self.next_address = next_address
        self.peak = self.reserved

    def close(self) -> None:
        """Unlink every segment and block (each block points at its neighbours and its segment, each
        segment at its last block and its pool): reference counting then frees a replayed allocator at
        once, where the cyclic collector would have to find its few hundred objects, every sweep point."""
        for seg in self.segments:
            block = seg.last
            while block is not None:
                block.prev, block.next, block.segment, block = None, None, None, block.prev
            seg.last = seg.pool = None
        self.segments = []
        self._pools.clear()
        self._expandable.clear()
        self._waiting.clear()

    def synchronize(self) -> None:
        """Every pending event completes (`synchronize_and_free_events`, as `empty_cache` runs first)."""
        while self._waiting:
            self._release(heapq.heappop(self._waiting)[2])

    def release_cached(self) -> None:
        """`release_cached_blocks` (`torch.cuda.empty_cache`, and `malloc` before its retry): every event
        completes, then each segment with nothing allocated goes back to the driver; an expandable
        segment unmaps the whole pages of its free end (pages inside it stay mapped: the model keeps a
        segment's mapped range contiguous, so it returns no more than PyTorch does)."""
        self.synchronize()
        kept = []
        for seg in self.segments:
            last = seg.last
            if not seg.expandable:
                if last.prev is None and last.state == "free":
                    self._drop(seg)
                    continue
            elif last is not None and last.state == "free":
                page = SMALL_BUFFER if seg.small else LARGE_BUFFER
                mapped = -(-(last.address - seg.address) // page) * page
                pool = seg.pool
                self._take(pool, last)
                self.reserved -= seg.size - mapped
                seg.size = mapped
                last.size = seg.address + mapped - last.address
                if last.size:
                    self._put(pool, last)
                else:  # the whole block was unmapped
                    seg.last = last.prev
                    if last.prev is not None:
                        last.prev.next = None
            kept.append(seg)
        self.segments = kept

    def releasable(self) -> int:
        """Bytes `torch.cuda.empty_cache()` would return now: segments with nothing allocated (expandable
        segments: the whole pages inside free blocks)."""
        total = 0
        for seg in self.segments:
            if seg.expandable:
                page = SMALL_BUFFER if seg.small else LARGE_BUFFER
                for b in self._blocks(seg):
                    if b.state == "free":
                        lo = -(-(b.address - seg.address) // page) * page
                        hi = (b.address + b.size - seg.address) // page * page
                        total += max(0, hi - lo)
            elif seg.last.prev is None and seg.last.state == "free":  # one free block: free neighbours always merge
                total += seg.size
        return total

    def layout(self, blocks: dict, offset: float) -> tuple:
        """Everything the next requests and frees of an allocator with no `limit` depend on, addresses
        included: (reserved, where the next segment goes, how many segments, the pending frees' blocks and
        times less `offset`), and the block each live buffer of `blocks` holds. Two points of one replay of
        one event sequence with equal layouts play the rest of it alike: with no limit no segment is returned, so
        the same count is the same segments, each as large (reserved is their sum, and none shrinks),
        and free neighbours always merge, so every free block is a gap between the blocks in use. Buffers
        outside `blocks` (the persistent ones) must be the same in both.

        With a `limit` segments go back to the driver and new ones take new addresses, so two layouts
        compare by position (placement.py `same_places`), from what is kept here while it is cheap: reserved,
        the segments (expandable: their sizes too, which change), copies of the pools (an entry's size and
        address are its block's while the block is free) and each live buffer's block's address and size."""
        if self.limit is not None:
            return ((self.reserved, self.segments[:],
                     [seg.size for seg in self.segments] if self.config.expandable_segments else None,
                     {key: pool[:] for key, pool in self._pools.items() if pool}),
                    [(block.address, block.size) for block in blocks.values()])
        return ((self.reserved, self.next_address, len(self.segments),
                 sorted((t - offset, block.address, block.size) for t, _, block in self._waiting)),
                [(buf, block.address, block.size) for buf, block in blocks.items()])

    def state(self) -> tuple:
        """The pools' layout, addresses aside: each segment's stream, pool and blocks (size, state), in
        address order. Two allocators in the same state serve the same requests alike (new segments go
        above all others, ties break on the lowest address)."""
        return tuple((s.stream, s.small, s.size, tuple((b.size, b.state) for b in self._blocks(s)))
                     for s in self.segments)

    # ---- the allocator's steps ---------------------------------------------------------
    def _best_fit(self, pool: list[tuple[int, int, Block]], size: int) -> int:
        """`get_free_block`: the index of the smallest free block >= size (lowest address among
        equals) in `pool`; -1 when none may serve."""
        i = bisect.bisect_left(pool, (size,))
        if i == len(pool):
            return -1
        limit = self.config.max_split_size
        if limit is not None:
            if size < limit <= pool[i][0]:
                return -1  # "do not return an oversized block for a small request"
            if size >= limit and pool[i][0] >= size + LARGE_BUFFER:
                return -1  # "do not return an oversized block for a large request"
        block = pool[i][2]
        if block.segment.expandable and block.segment.last is block and i + 1 < len(pool):
            return i + 1  # best fit counts the end block at the size it can grow to: a smaller one goes first
        return i

    def _alloc_block(self, key: tuple[str, bool], size: int) -> Block:
        """`alloc_block`, and `malloc`'s way out when the driver refuses it: with `max_split_size`,
        `release_available_cached_blocks` and ask again; then `release_cached_blocks` and a retry
        (`alloc_block(params, true)`: a new segment even if a block the release merged would fit now);
        then OutOfMemoryError."""
        if self.limit is not None and self.reserved + self._growth(key, size) > self.limit:
            released = self.config.max_split_size is not None and self._release_oversize(key, size)
            if not released or self.reserved + self._growth(key, size) > self.limit:
                self.release_cached()
                self.retries += 1
                need = self._growth(key, size)
                if self.reserved + need > self.limit:
                    raise OutOfMemory(f"tried to allocate {need} B with {self.reserved} B reserved of {self.limit} B")
        block = self._grow(key, size) if self.config.expandable_segments else self._new_segment(key, size)
        if self.reserved > self.peak:
            self.peak = self.reserved
        return block

    def _growth(self, key: tuple[str, bool], size: int) -> int:
        """Bytes the driver must give for a request no cached block fits: a new segment, or the pages
        an expandable segment maps at its end."""
        if not self.config.expandable_segments:
            return segment_size(size)
        seg = self._expandable.get(key)
        return _mapped_end(seg, key[1], size) - seg.size if seg is not None else _mapped_end(None, key[1], size)

    def _release_oversize(self, key: tuple[str, bool], size: int) -> bool:
        """`release_available_cached_blocks`: the smallest cached whole segment >= max(size,
        max_split_size) of the request's pool goes back; without one, the largest oversize ones, down
        while they add up to less than that. False when they do not add up."""
        limit = self.config.max_split_size
        pool = self._pools[key]
        target = max(size, limit)
        i = bisect.bisect_left(pool, (target,))
        if i < len(pool):
            block = pool[i][2]
            if block.prev is None and block.next is None and not block.segment.expandable:
                seg = block.segment
                self._drop(seg)
                self.segments.remove(seg)
                return True
            return False
        total = 0
        for _, _, block in reversed(pool[:]):
            if total >= target or block.size < limit:
                break
            if block.prev is None and block.next is None and not block.segment.expandable:
                total += block.size
                seg = block.segment
                self._drop(seg)
                self.segments.remove(seg)
        return total >= target

    def _drop(self, seg: Segment) -> None:
        """`release_block`: a free whole segment goes back to the driver (the caller unlists it; its block
        and it are unlinked, as `close` does, so reference counting frees them)."""
        self._take(seg.pool, seg.last)
        self.reserved -= seg.size
        seg.last.segment = None
        seg.last = seg.pool = None

    def _new_segment(self, key: tuple[str, bool], size: int) -> Block:
        """`alloc_block`: cudaMalloc a segment of `get_allocation_size(size)` holding one block."""
        seg = self._segment(key, segment_size(size), expandable=False)
        block = Block(seg.address, seg.size, seg, None, None)
        seg.last = block
        return block

    def _grow(self, key: tuple[str, bool], size: int) -> Block:
        """`try_allocate_expandable_block`: map pages at the end of the pool's expandable segment, joined
        to the free block there, until the request fits."""
        seg = self._expandable.get(key)
        if seg is None:
            seg = self._expandable[key] = self._segment(key, 0, expandable=True)
        last = seg.last
        joined = last is not None and last.state == "free"
        start = last.address if joined else seg.address + seg.size
        mapped = _mapped_end(seg, key[1], size)
        self.reserved += mapped - seg.size
        seg.size = mapped
        if joined:
            self._take(self._pools[key], last)
            last.size = seg.address + mapped - last.address
            return last
        block = Block(start, seg.address + mapped - start, seg, last, None)
        if last is not None:
            last.next = block
        seg.last = block
        return block

    def _segment(self, key: tuple[str, bool], size: int, expandable: bool) -> Segment:
        seg = Segment(self.next_address, size, key[0], key[1], expandable, self._pools[key])
        span = size if not expandable else 1 << 40  # an expandable segment reserves address space to grow into
        self.next_address += -(-max(span, 1) // self.segment_align) * self.segment_align
        self.segments.append(seg)
        self.reserved += size
        return seg

    def _release(self, block: Block) -> None:
        """`free_block`: merge with free neighbours of the same segment, then back into the pool."""
        seg = block.segment
        pool = seg.pool
        nxt = block.next
        if nxt is not None and nxt.state == "free":  # `absorb(block, nxt)`, inlined: the hot path of every free
            del pool[bisect_left(pool, (nxt.size, nxt.address))]
            block.size += nxt.size
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            elif seg.last is nxt:
                seg.last = block
        prev = block.prev
        if prev is not None and prev.state == "free":
            del pool[bisect_left(pool, (prev.size, prev.address))]
            absorb(prev, block)
            block = prev
        block.state = "free"
        insort(pool, (block.size, block.address, block))

    @staticmethod
    def _put(pool: list[tuple[int, int, Block]], block: Block) -> None:
        block.state = "free"
        bisect.insort(pool, (block.size, block.address, block))

    @staticmethod
    def _take(pool: list[tuple[int, int, Block]], block: Block) -> None:
        del pool[bisect.bisect_left(pool, (block.size, block.address))]

    @staticmethod
    def _blocks(seg: Segment):
        """The segment's blocks in address order (walked back from its last block)."""
        out, b = [], seg.last
        while b is not None:
            out.append(b)
            b = b.prev
        return reversed(out)


def _mapped_end(seg: Segment | None, small: bool, size: int) -> int:
    """The mapped size of an expandable segment once a request of `size` fits at its end: whole pages
    (`segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer`), the free end block joined."""
    page = SMALL_BUFFER if small else LARGE_BUFFER
    if seg is None:
        return -(-size // page) * page
    last = seg.last
    start = last.address if last is not None and last.state == "free" else seg.address + seg.size
    return max(seg.size, -(-(start - seg.address + size) // page) * page)
