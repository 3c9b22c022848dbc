"""fsdp-sim against PyTorch's FSDPMemTracker: agreement and speed on the referee grid.

For each case of fsdp_sim.torch_tools.referee.CASES: the tracker's peak (FSDP2 under FakeTensorMode with a
fake process group, CPU, one tracked step after a warm-up step), fsdp-sim's simulated peak, the error,
and the wall time of each (the tracker's run in-process, torch already imported; fsdp-sim's
`simulate()`), with their ratio. Needs torch (`pip install -e '.[torch]'`).
Run: python benchmarks/bench_referee.py
"""

from __future__ import annotations

import time

from fsdp_sim.torch_tools.memtracker import run_fsdp_mem_tracker
from fsdp_sim.torch_tools.reference_model import ReferenceConfig
from fsdp_sim.torch_tools.referee import BASE, CASES, case_settings, simulate_reference


def main() -> None:
    print(f"{'configuration':<34}{'tracker peak B':>16}{'sim peak B':>14}{'error %':>9}"
          f"{'tracker s':>11}{'sim ms':>9}{'speed-up':>10}")
    for case_id, model, run in CASES:
        cfg, settings = ReferenceConfig(**(BASE | model)), case_settings(run)
        t0 = time.perf_counter()
        tracker = run_fsdp_mem_tracker(cfg, **settings)
        t_tracker = time.perf_counter() - t0
        t0 = time.perf_counter()
        sim = simulate_reference(cfg, **settings)
        t_sim = time.perf_counter() - t0
        error = 100 * (sim["peak_bytes"] - tracker["peak_bytes"]) / tracker["peak_bytes"]
        print(f"{case_id:<34}{tracker['peak_bytes']:>16,}{sim['peak_bytes']:>14,}{error:>+9.3f}"
              f"{t_tracker:>11.2f}{t_sim * 1e3:>9.2f}{t_tracker / t_sim:>9.0f}x", flush=True)
    print("(tracker: 2 iterations in one process, torch imported beforehand; sim: parse + simulate)")


if __name__ == "__main__":
    main()
