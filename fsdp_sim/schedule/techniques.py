"""The techniques a step is given, chosen in one place.

Read `techniques_of` as torchtitan's `parallelize_llama`: one line per technique, guarded by its switch.
Each technique is a part with its own file and state (tensor parallel `tp.py`, CPU offload and save_on_cpu
`offload.py`, the float8 all-gather `float8.py`); the step (`autograd.py`, the runtimes beside it) holds
them in `self.techniques` and calls a part's hooks where PyTorch's runtime calls the technique's code: a
part that is None is not used, and the step does what it does without it. A part reads the step it is
given (its graph, settings and autograd state) and never the other parts.

A new technique is a new file with its part and one line here, plus the calls at its hook points.
Techniques that change the model rather than the step (LoRA, activation checkpointing, float8 Linears,
the TP plan's sharded shapes) are applied to the workload before the step is built (`workload/`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sim.schedule.float8 import Float8AllGather
from fsdp_sim.schedule.offload import ActivationOffload, CPUOffload
from fsdp_sim.schedule.tp import TensorParallelCompute


@dataclass(frozen=True, slots=True)
class Techniques:
    """The parts a step uses; None where the run does not use the technique."""

    tensor_parallel: TensorParallelCompute | None = None  # each module's compute split around its TP collectives
    cpu_offload: CPUOffload | None = None  # CPUOffloadPolicy: state on the host, copies both ways, CPU step
    activation_offload: ActivationOffload | None = None  # save_on_cpu: saved tensors to the host and back
    float8_all_gather: Float8AllGather | None = None  # torchao's float8 all-gather: the amaxes its casts need

    def names(self) -> list[str]:
        """The techniques in use, by field name."""
        return [name for name in self.__slots__ if getattr(self, name) is not None]


def techniques_of(step) -> Techniques:
    """The parts `step` is given, from its settings."""
    s = step.s
    return Techniques(
        tensor_parallel=TensorParallelCompute(step) if s.tp > 1 else None,
        cpu_offload=CPUOffload(step) if s.offload_params else None,
        activation_offload=ActivationOffload(step) if s.activation_offload else None,
        float8_all_gather=Float8AllGather(step) if s.float8_all_gather else None,
    )
