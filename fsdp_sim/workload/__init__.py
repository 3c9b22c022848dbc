"""The model's trace as plain data, and the builders that produce it."""

from fsdp_sim.workload.model import Module, Param, Workload
from fsdp_sim.workload.presets import PRESETS
from fsdp_sim.workload.transformer import TransformerDims, build_transformer

__all__ = ["PRESETS", "Module", "Param", "TransformerDims", "Workload", "build_transformer"]
