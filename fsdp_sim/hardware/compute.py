"""Price the compute-stream ops of a step: GPU time by kernel class, and the CPU issue thread's cost.

A module's op carries its `Kernel`s (see `kernels.py` for their prices); an op priced only by FLOPs and
bytes (a traced workload, an FSDP copy, the optimizer's foreach passes) runs its FLOPs at the GPU's
large-GEMM rate and its bytes at the eager elementwise efficiency for their size. A profiler-measured
module time (`compute: {trace: ...}`) replaces the estimate; it is billed as matmul time, and so
slowed as compute-bound time is at the slowest rank's pace (`Sustained.pace`).
"""

from __future__ import annotations

from fsdp_sim.hardware.kernels import ComputeOptions, KernelTimes, elementwise_time, gemm_rate, kernels_time, launch_cost_s
from fsdp_sim.schedule.ops import COLLECTIVES, Op


MAX_SHARED_PRICES = 100_000  # op contents priced per (GPU, dtype, options) kept between steps: a bound on memory
MAX_SHARED_TABLES = 64  # (GPU, dtype, options) tables kept: a sweep over options or GPUs stays bounded too
_SHARED: dict[tuple, tuple] = {}  # (id(gpu), dtype, options) -> (gpu, {op content: KernelTimes})


def _shared_prices(gpu, dtype: str, options: ComputeOptions) -> dict[tuple, KernelTimes]:
    """The prices of op contents on `gpu` in `dtype` with `options`, shared by every step in this process.

    Pricing is a pure function of these and the op's content, and profiles are loaded once (cached), so
    the points of a sweep on one GPU reuse one table; the entry holds the profile so its id stays its own.
    """
    key = (id(gpu), dtype, options)
    entry = _SHARED.get(key)
    if entry is None or entry[0] is not gpu:
        if len(_SHARED) >= MAX_SHARED_TABLES:
            _SHARED.clear()
        entry = _SHARED[key] = (gpu, {})
    return entry[1]


class ComputeCosts:
    """`times(op)` (GPU seconds by class), `duration(op)` and `host_s(op)` for one GPU, compute dtype and options."""

    def __init__(self, gpu, dtype: str, options: ComputeOptions) -> None:
        self.gpu, self.dtype, self.options = gpu, dtype, options
        self.matmul_flops = gemm_rate(gpu, dtype, options.allow_tf32)
        self._launch = {False: launch_cost_s(False, options), True: launch_cost_s(True, options)}
        self._launch_by_phase: dict[str, float] = {}  # `_launch` by op phase: a step has a handful of phases
        self._cache: dict[tuple, KernelTimes] = {}
        self._by_op: dict[int, KernelTimes] = {}  # the engine and the analysis ask about one op many times
        self._shared = _shared_prices(gpu, dtype, options)

    def times(self, op: Op) -> KernelTimes:
        t = self._by_op.get(op.id)
        if t is None:
            # ops of identical content (every block's forward) share one pricing
            key = (op.kind, op.kernel_pass, op.flops, op.hbm_bytes, op.measured_s, op.launches, id(op.kernels))
            t = self._cache.get(key)
            if t is None:
                # a sweep's points share shapes: the price by content outlives this step (kernels by value)
                content = (*key[:-1], op.kernels)
                t = self._shared.get(content)
                if t is None:
                    if len(self._shared) >= MAX_SHARED_PRICES:
                        self._shared.clear()
                    t = self._shared[content] = self._price(op)
                self._cache[key] = t
            self._by_op[op.id] = t
        return t

    def _price(self, op: Op) -> KernelTimes:
        if op.measured_s is not None:  # measured on a mean GPU: at the step's pace as compute-bound time is
            return KernelTimes(matmul=op.measured_s * self.gpu.sustained.pace, launches=max(1, op.launches))
        if op.kernels:
            return kernels_time(self.gpu, op.kernels, op.kernel_pass, self.dtype, self.options)
        return KernelTimes(matmul=op.flops / self.matmul_flops, memory=elementwise_time(self.gpu, op.hbm_bytes),
                           launches=op.launches)

    def duration(self, op: Op) -> float:
        """`times(op).total`, the sum in its order, without the property's call (asked once per timed op)."""
        t = self._by_op.get(op.id) or self.times(op)
        return t.matmul + t.attention + t.memory

    def host_s(self, op: Op) -> float:
        """The CPU issue thread's time for a timed op: its kernel launches (a collective is one launch)."""
        phase = op.phase
        cost = self._launch_by_phase.get(phase)
        if cost is None:
            cost = self._launch_by_phase[phase] = self._launch[phase.startswith("backward")]
        return cost if op.kind in COLLECTIVES else (self._by_op.get(op.id) or self.times(op)).launches * cost
