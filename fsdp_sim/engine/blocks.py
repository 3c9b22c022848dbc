"""The caching allocator's data (engine/allocator.py): a segment the driver gave it and the blocks it is
cut into, each linked to its neighbours so that a freed block merges with free ones beside it
(CUDACachingAllocator.cpp's `Block`: `prev`, `next`, `allocated`, `event_count`; its `segment` list)."""

from __future__ import annotations


class Segment:
    """One cudaMalloc'd segment (or one expandable segment: `size` is what is mapped)."""

    __slots__ = ("address", "size", "stream", "small", "expandable", "last", "pool")

    def __init__(self, address: int, size: int, stream: str, small: bool, expandable: bool, pool: list) -> None:
        self.address, self.size, self.stream, self.small, self.expandable = address, size, stream, small, expandable
        self.pool = pool  # the free blocks of its stream and size class (its blocks go back there)
        self.last: Block | None = None  # the block at the mapped end (expandable segments grow from it)


class Block:
    """A range of a segment: allocated, waiting for its stream uses, or free in its pool."""

    __slots__ = ("address", "size", "segment", "prev", "next", "state")

    def __init__(self, address: int, size: int, segment: Segment, prev: Block | None, nxt: Block | None) -> None:
        self.address, self.size, self.segment, self.prev, self.next = address, size, segment, prev, nxt
        self.state = "free"  # "allocated" | "waiting" (record_stream events pending) | "free"


def absorb(block: Block, nxt: Block) -> None:
    """`try_merge_blocks`: `block` takes in the block after it."""
    block.size += nxt.size
    after = block.next = nxt.next
    if after is not None:
        after.prev = block
    if block.segment.last is nxt:
        block.segment.last = block
