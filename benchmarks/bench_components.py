"""Each component the time model uses, priced by the model beside the published measurement it comes from.

Run: python benchmarks/bench_components.py
A row whose model figure is far from its reference is a component to fix, never a constant to tune:
the step time is only as right as these pieces. Reference keys ([C#], [S#], [I#]) are listed with their
public sources in hardware_profiles/README.md ("Source keys").

Each row shows the model at the rate the reference benchmark ran at (`model`, compared with it) and at
the rate the GPU sustains through a long training step (`sustained`, what a simulated step uses: the
profile's `sustained:` derating, hardware/profiles.py `Sustained`). The last table gives each profile's
derating and its source.
"""

from __future__ import annotations

from fsdp_sim.hardware.collectives import ProcessGroup, collective_time
from fsdp_sim.hardware.costs import NCCL_HBM_TRAFFIC_PER_LINK_BYTE
from fsdp_sim.hardware import kernel_data as kd
from fsdp_sim.hardware.kernels import (ComputeOptions, attention_tflops, eager_memory, fallback_generation, gemm_time,
                                       kernels_time, memory_efficiency, select_sdpa_backend)
from fsdp_sim.hardware.profiles import load_profile, profile_names
from fsdp_sim.workload.kernels import block_kernels
from fsdp_sim.workload.presets import PRESETS

GiB, MiB = 1 << 30, 1 << 20
ROWS: list[tuple[str, str, float, float, float, str]] = []  # component, unit, reference, model, sustained, source


def row(component: str, unit: str, reference: float, model, source: str) -> None:
    """`model` is a function of a profile (called at its benchmark rates, then as sustained) or a number
    no derating moves (collectives, counts)."""
    if callable(model):
        bench, sustained = model(True), model(False)
    else:
        bench = sustained = model
    ROWS.append((component, unit, reference, bench, sustained, source))


def profile(name: str, benchmark: bool):
    gpu = load_profile(name)
    return gpu.at_benchmark_rates() if benchmark else gpu


def gemms() -> None:
    for name, (m, n, k), ref, src in [
        ("h100-sxm", (4096, 4096, 4096), 783.3, "XLA H100 table [C2]"),
        ("h100-sxm", (256, 4096, 4096), 412.0, "XLA H100 table, small M [C2]"),
        ("h100-sxm", (4096, 1024, 4096), 738.5, "XLA H100 table, GQA k/v-like [C2]"),
        ("h100-sxm", (2048, 2048, 13312), 794.5, "MAMF best shape [C1]"),
        ("a100-80gb", (1024, 10240, 5120), 271.2, "MAMF best shape [C1]"),
        ("a100-80gb", (8192, 8192, 8192), 271.32, "cuBLAS 8192^3 [C1 2nd]"),
        ("h100-sxm-96gb", (8192, 8192, 8192), 585.2, "FBGEMM bf16, H100 500 W [C4]"),
        ("h100-sxm-96gb", (65536, 7168, 8192), 575.1, "FBGEMM bf16, H100 500 W [C4]"),
        ("h100-sxm-96gb", (65536, 8192, 3584), 546.3, "FBGEMM bf16, H100 500 W [C4]"),
    ]:
        row(f"GEMM bf16 {m}x{n}x{k} on {name}", "TFLOPS", ref,
            lambda b, name=name, m=m, n=n, k=k: 2 * m * n * k / gemm_time(profile(name, b), m, n, k, "bf16") / 1e12, src)
    row("fp32 matmul 10240^3 on a100, TF32 off", "s", 0.11,
        lambda b: gemm_time(profile("a100-80gb", b), 10240, 10240, 10240, "fp32"), "PyTorch docs cuda.rst [C6]")
    row("fp32 matmul 10240^3 on a100, TF32 on", "s", 0.016,
        lambda b: gemm_time(profile("a100-80gb", b), 10240, 10240, 10240, "fp32", allow_tf32=True),
        "PyTorch docs cuda.rst [C6]")

    def mlp(f: int, b: bool) -> float:
        return sum(gemm_time(profile("h100-sxm", b), 8192, n, k, "bf16") for n, k in ((f, 4096), (f, 4096), (4096, f)))

    row("SwiGLU MLP GEMMs d_ff 10922 / 10944 on h100 (time ratio)", "x", 398.4 / 272.7 * 10922 / 10944,
        lambda b: mlp(10922, b) / mlp(10944, b), "stas00 SwiGLU width benchmark [C1]")


def attention() -> None:
    def rate(name: str, b: bool, backend: str, s: int, causal: bool, d: int = 128) -> tuple[float, float]:
        return attention_tflops(profile(name, b), backend, d, s, causal)

    for name in ("a100-80gb", "h100-sxm"):
        for s, ref in ((2048, (155, 265)), (8192, (182, 308))):
            row(f"FA2 fwd+bwd causal d128 s={s} on {name}", "TFLOPS", ref[name == "h100-sxm"],
                lambda b, name=name, s=s: 3.5 / (1 / rate(name, b, "flash", s, True)[0]
                                                 + 2.5 / rate(name, b, "flash", s, True)[1]) / 1e12,
                "flash-attention benchmark figure [C9]")
    row("FA2 backward non-causal d128 s=8192 on a100 (fwd+bwd rate)", "TFLOPS", 201,
        lambda b: rate("a100-80gb", b, "flash", 8192, False)[1] / 1e12, "[C9]")
    row("FA2 backward non-causal d128 s=8192 on h100", "TFLOPS", 318,
        lambda b: rate("h100-sxm", b, "flash", 8192, False)[1] / 1e12, "FA3 paper backward figure [C12]")
    row("cuDNN SDPA fwd (1, 24, 4608, 128) on h100", "TFLOPS", 631.3,
        lambda b: rate("h100-sxm", b, "cudnn", 4608, False)[0] / 1e12, "Tritonbench, pytorch#142132 [C14]")
    backend = select_sdpa_backend("sm90", ComputeOptions(torch_version=(2, 6)))
    row("default SDPA fwd (1, 24, 4608, 128) on h100, torch 2.6", "TFLOPS", 329.5,
        lambda b: rate("h100-sxm", b, backend, 4608, False)[0] / 1e12, "Tritonbench, pytorch#142132 [C14]")


def memory_bound() -> None:
    for name, kind, shape, nbytes, ref, src in [
        ("h100-sxm", "norm", (4096, 16384), 0, 0.54, "torch.nn.RMSNorm fwd 4096x16384 on H100 [C5]"),
        ("a100-80gb", "norm", (4096, 16384), 0, 1.0596e12 / 2.039e12, "nn.LayerNorm fwd fp32 4096x16384 on A100 [C5]"),
        ("h100-sxm", "activation", (8192, 32768), 0, 0.32, "eager silu(a)*b on H100 [C5]"),
        ("h200", "elementwise", (), 126e6, 0.70, "torch.maximum 126 MB on H200 [C18]"),
        ("mi300x", "elementwise", (), 2**32, 3205e9 / 5.3e12, "torch.sum 4.3 GB on MI300X [E1]"),
        ("a100-80gb", "cross_entropy", (16384, 131072), 0, 0.41, "HF cross-entropy fwd on A100 [C5]"),
        ("b200", "rope", (8192, 8192), 0, 268435456 / 0.8675e-3 / 8.0e12, "eager rotate_half RoPE q+k on B200 [E2]"),
    ]:
        arch = load_profile(name).arch
        row(f"{kind} {shape or f'{nbytes / 1e6:.0f} MB'} on {name}, fraction of HBM peak", "", ref,
            lambda b, name=name, kind=kind, shape=shape, nbytes=nbytes, arch=arch:
            memory_efficiency(kind, shape, nbytes, False, arch) * profile(name, b).sustained.memory, src)
    row("RMSNorm torch.compile 32Kx4K on h100", "GB/s", 2300,
        lambda b: memory_efficiency("norm", (32768, 4096), 0, True, "sm90") * profile("h100-sxm", b).memory_Bps / 1e9,
        "Quack figure [C17]")
    # a compiled block's generated kernels (workload/compiled_block.py): Inductor's reductions and pointwise
    row("Inductor reduction (RMSNorm) 32Kx16K on h100", "GB/s", 1800,
        lambda b: memory_efficiency("inductor_reduction", (32768, 16384), 0, True, "sm90")
        * profile("h100-sxm", b).memory_Bps / 1e9, "torch.compile 2.7.1, Quack figure [C17]")
    row("Inductor pointwise (RoPE q+k, 268 MB) on b200", "TB/s", 5.71,
        lambda b: memory_efficiency("inductor_pointwise", (), 268e6, True, "sm100") * profile("b200", b).memory_Bps / 1e12,
        "one compiled rotate_half kernel, 0.047 ms, pytorch PR #176223 (in-situ.md 6)")


# the size at which each kind's eager fraction is shown per profile: a Llama-3-8B-like row width, 126 MB moved
EAGER_SHOWN = (("norm", (8192, 4096), 0), ("norm_unfused", (8192, 4096), 0), ("rope", (8192, 8192), 0),
               ("activation", (8192, 14336), 0), ("cross_entropy", (8192, 128256), 0), ("elementwise", (), 126e6))


def eager_by_profile() -> None:
    """Each profile's eager memory-bound fractions of HBM peak (benchmark rates), its generation's own
    measurement or another's standing in (*, the gap), and where each figure was measured."""
    print("\neager memory-bound kernels, fraction of HBM peak on ideal bytes (* = another generation's figure: a gap)")
    print(f"{'profile':<16}{'arch':<8}" + "".join(f"{k:>15}" for k, _, _ in EAGER_SHOWN))
    for name in profile_names():
        arch = load_profile(name).arch
        cells = [f"{memory_efficiency(kind, shape, nbytes, False, arch):.3f}{'' if eager_memory(kind, arch).own else '*':1}"
                 for kind, shape, nbytes in EAGER_SHOWN]
        print(f"{name:<16}{arch:<8}" + "".join(f"{c:>15}" for c in cells))
    for kind in kd.EAGER_MEMORY:
        for arch in kd.EAGER_MEMORY[kind]:
            print(f"  {kind} on {arch} ({kd.GENERATIONS[arch]}): {eager_memory(kind, arch).source}")
        print(f"  {kind} elsewhere: {kd.GENERATIONS[fallback_generation(kind)]}'s figure, the gap named")


def collectives() -> None:
    cases = [
        ("h100-sxm", "all_gather", 16 * GiB, 8, 1, 350e9, "8xH100 AG busbw plateau 350 GB/s [S20e]"),
        ("h100-sxm", "all_gather", 256 * MiB, 8, 1, 350e9, "8xH100 AG plateau [S20e]; no sourced 256 MiB point (gap)"),
        ("h200", "all_gather", 16 * GiB, 8, 1, 361.4e9, "8xH200 AG busbw, nccl-tests 16 GiB [S8]"),
        ("h200", "all_reduce", 256 * MiB, 8, 1, 436.2e9, "8xH200 AR (NVLS) busbw, torch 256 MiB [S8]"),
        ("a100-80gb", "all_reduce", 256 * MiB, 8, 1, 194.1e9, "8xA100 AR busbw, nccl-tests 256 MiB [S8]"),
        ("a100-80gb", "all_reduce", 4 * GiB, 16, 2, 192e9, "DGX-A100 8x HDR multi-node AR busbw [S20a]"),
        ("b200", "all_reduce", 4 * GiB, 32, 4, 377.3e9, "4x8 B200 over 8x400G EFA, AR 4 GiB [S8]"),
        ("h100-sxm", "all_gather", 2 * GiB, 256, 32, 200e9, "32x8 H100 8x400G RoCE AG 2 GB [C29 nccl#1218]"),
    ]
    for name, kind, size, ranks, nodes, ref, src in cases:
        fabric = load_profile(name).fabric
        t = collective_time(kind, size, ProcessGroup(ranks, nodes), fabric)
        factor = (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks
        row(f"{kind} {size / MiB:.0f} MiB on {nodes}x{ranks // nodes} {name} (busbw)", "GB/s", ref / 1e9,
            size * factor / t / 1e9, src)
    fabric = load_profile("h100-sxm").fabric
    for ranks, nodes, ref in ((8, 1, 32.2), (64, 8, 296.8), (256, 32, 1204)):
        row(f"ring AG latency floor, {nodes}x8 H100 (4 B)", "us", ref,
            collective_time("all_gather", 4 * ranks, ProcessGroup(ranks, nodes), fabric) * 1e6,
            "NCCL 2.27 tuner, Simple [C27]")


def overheads() -> None:
    h100, a100 = load_profile("h100-sxm"), load_profile("a100-80gb")
    ks = block_kernels(PRESETS["llama3-8b"], 1, 8192, 2, causal=True)
    t = kernels_time(h100, ks, "forward", "bf16", ComputeOptions())
    row("eager kernels per Llama decoder layer, forward", "count", 40, t.launches, "HF eager count [C4.2 est]")
    t = kernels_time(h100, ks, "backward", "bf16", ComputeOptions())
    row("eager kernels per Llama decoder layer, backward", "count", 90, t.launches, "[C4.2 est: ~80-100]")
    # interference: a GEMM beside an all-gather on A100 (the model's SM and HBM shares of a pure GEMM)
    held = a100.fabric.nccl_channels
    row("GEMM slowdown beside an NCCL all-gather, A100", "x", 2.08 / 1.18, a100.sm_count / (a100.sm_count - held),
        "one user's profile, nccl#1428 [C24] (tail effects not modelled)")
    held = h100.fabric.nccl_channels
    row("overlapped compute slowdown, average over GPT/LLaMA workloads", "x", 1.189,
        h100.sm_count / (h100.sm_count - held), "arXiv 2507.03114 [C25] (model: a GEMM on H100 beside one collective)")
    demand = NCCL_HBM_TRAFFIC_PER_LINK_BYTE * 350e9
    row("memory-bound kernel slowdown beside an 8xH100 all-gather", "x", float("nan"),
        1 + demand / h100.memory_Bps, "no measurement found (component-timing §5.2 gap)")


def sustained_rates() -> None:
    """Each profile's derating: its clocks and what a long step runs compute- and memory-bound kernels at."""
    print(f"\n{'profile':<16}{'limit W':>8}{'bench MHz':>10}{'settled MHz':>12}{'compute':>9}{'memory':>8}  source")
    for name in profile_names():
        s = load_profile(name).sustained
        clocks = [f"{c:.0f}" if c is not None else "-" for c in (s.benchmark_clock_mhz, s.sm_clock_mhz)]
        print(f"{name:<16}{s.power_limit_w:>8.0f}{clocks[0]:>10}{clocks[1]:>12}{s.compute:>9.3f}{s.memory:>8.3f}  {s.source}")


def main() -> None:
    for part in (gemms, attention, memory_bound, collectives, overheads):
        part()
    print(f"{'component':<66}{'unit':>7}{'reference':>11}{'model':>10}{'model/ref':>10}{'sustained':>10}  source")
    for component, unit, ref, model, sustained, src in ROWS:
        ratio = model / ref if ref == ref and ref else float("nan")
        print(f"{component:<66}{unit:>7}{ref:>11.4g}{model:>10.4g}{ratio:>10.2f}{sustained:>10.4g}  {src}")
    sustained_rates()
    eager_by_profile()


if __name__ == "__main__":
    main()
