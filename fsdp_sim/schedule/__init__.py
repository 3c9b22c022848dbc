"""FSDP runtime semantics: which op is issued when, on which stream, waiting on what. No timing."""
