"""Plays an op graph in time (SimPy) and keeps the memory ledger. Knows nothing of FSDP."""

from fsdp_sim.engine.ledger import LedgerError, MemoryTrace, replay
from fsdp_sim.engine.simulator import QueueLayout, Timing, play, queue_layout

__all__ = ["LedgerError", "MemoryTrace", "QueueLayout", "Timing", "play", "queue_layout", "replay"]
