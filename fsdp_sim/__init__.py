"""fsdp-sim: will this FSDP training step fit in GPU memory, and how fast will it run?"""

__version__ = "0.1.0"
