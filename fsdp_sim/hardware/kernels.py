"""How long each kernel of a module takes on a GPU, from measured single-kernel throughputs.

Pure functions of (GPU, kernel, options) -> seconds, testable without SimPy; the tables and their sources
are in `kernel_data.py`.
- GEMM: the GPU's large-GEMM rate (peak x MAMF efficiency, per dtype) times a shape factor read off XLA's
  measured H100 table (inverse-distance interpolation in log2 (m, n, k), clamped to the table's range),
  corrected for wave quantisation on the GPU's SM count (128 x 256 output tiles) and for dimensions that
  are not a multiple of 128 bytes. fp32 runs at the fp32 (SIMT) rate unless TF32 is allowed, as
  `torch.backends.cuda.matmul.allow_tf32 = False` (PyTorch's default) does.
- Attention: the SDPA backend torch picks on that GPU (`sdpa_backend`), at its measured forward and
  backward throughput by sequence length, head dim and causality (causal FLOPs halved, as flash-attention's
  benchmarks count them). A GPU without a table of its own takes the fraction of peak of the nearest one.
- Memory-bound kinds: ideal bytes at the measured fraction of HBM peak of eager kernels on the GPU's
  generation (H100's where that generation was not measured, the gap named: `eager_memory`), or of fused
  ones under `torch_compile` (which also makes every memory-bound chain one launch). A compiled block's
  kernels are Inductor's own (`inductor_reduction` / `inductor_pointwise`, workload/compiled_block.py),
  at the bandwidth Inductor's generated kernels reach.
- Host: every launch costs the CPU issue thread its eager (or Inductor) launch cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from fsdp_sim.hardware import kernel_data as kd
from fsdp_sim.workload.model import Kernel

SDPA_BACKENDS = ("auto", "flash", "flash1", "cudnn")  # flash: FlashAttention-2; flash1: FlashAttention-1


@dataclass(frozen=True, slots=True)
class ComputeOptions:
    """The software knobs that move kernel speed: `compute.*` in a scenario."""

    allow_tf32: bool = False
    torch_compile: bool = False
    sdpa_backend: str = "auto"  # auto | flash | flash1 | cudnn
    torch_version: tuple[int, ...] = (2, 13)


def select_sdpa_backend(arch: str, options: ComputeOptions) -> str:
    """The SDPA backend torch's default priority order picks for 16-bit training inputs.

    FLASH is FlashAttention-1 before torch 2.2, which brought FlashAttention-2 into SDPA [F7]. torch 2.5.0
    put cuDNN first on H100; 2.5.1 moved it last after bugs (pytorch#138522), and 2.6-2.8 kept FLASH (FA2)
    first; 2.9 enabled cuDNN by default for SM 9.0 / 10.0 (pytorch#162073); 2.10 and 2.11 prefer it only
    above cuDNN 9.15, which the cuDNN 2.10 bundles is not ("what changes at 2.11 is the bundled cuDNN
    crossing the threshold") [C14, C15, C16, §2.7]. Other GPUs run FLASH.
    """
    if options.sdpa_backend != "auto":
        return options.sdpa_backend
    v = options.torch_version
    if v < (2, 2):
        return "flash1"
    cudnn_first = (v >= (2, 9) and v[:2] != (2, 10)) or v[:3] == (2, 5, 0) or v == (2, 5)
    return "cudnn" if cudnn_first and arch in ("sm90", "sm100") else "flash"


# ---- GEMM --------------------------------------------------------------------------------------------
def _waves(m: float, n: float, sms: int) -> float:
    """Fraction of the SMs busy over all waves, tiles / (waves x SMs), for the best of the library's tiles."""
    best = 0.0
    for tm, tn in kd.GEMM_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, tiles / (math.ceil(tiles / sms) * sms))
    return best


def _physical(m: float, n: float, k: float, sms: int) -> float:
    """The structure of a GEMM's efficiency: wave quantisation of its output tiles on the GPU's SMs, times
    the reduction-depth factor of XLA's K series (short K amortises each tile's loads over fewer steps)."""
    return _waves(m, n, sms) * _log_interp(kd.GEMM_K_SERIES, k)


@cache
def _table_points() -> tuple[tuple[float, float, float, float], ...]:
    """Each measured shape of XLA's H100 table as (log2 m, log2 n, log2 k, correction): its throughput
    relative to the table's best over its `_physical` term on the table's SMs. What does not depend on
    the shape asked, worked out once, like an import (`gemm_shape_factor` reads it for every shape it prices)."""
    best = max(row[3] for row in kd.H100_GEMM_TABLE)
    return tuple((math.log2(m), math.log2(n), math.log2(k), tflops / best / _physical(m, n, k, kd.H100_GEMM_SMS))
                 for m, n, k, tflops, _ in kd.H100_GEMM_TABLE)


def _weighted_corrections(m: int, n: int, k: int) -> tuple[float, float]:
    """The measured shapes' corrections summed with their inverse-distance weights at (m, n, k), and the
    weights' sum: (the correction, 1.0) at a measured shape. Returned apart, as `gemm_shape_factor` divides
    the product of its physical term and the first by the second."""
    x0, x1, x2 = math.log2(max(m, 1)), math.log2(max(n, 1)), math.log2(max(k, 1))
    num = den = 0.0
    for l0, l1, l2, ratio in _table_points():
        dist2 = (x0 - l0) ** 2 + (x1 - l1) ** 2 + (x2 - l2) ** 2
        if dist2 < 1e-12:
            return ratio, 1.0
        w = 1.0 / dist2 ** 2  # Shepard's inverse-distance weights, power 4 (a choice, not fitted: the nearest shapes dominate)
        num, den = num + w * ratio, den + w
    return num, den


@cache
def gemm_shape_factor(m: int, n: int, k: int, sms: int, itemsize: int) -> float:
    """Throughput of an (m, n, k) GEMM relative to the best shape of XLA's H100 table, in (0, 1].

    `_physical` times a correction interpolated from the measured shapes (inverse-distance weights, power
    4, in log2 (m, n, k)): at every measured shape on 132 SMs the table's own value, in between the
    structure of the physical term. The bf16 column serves every dtype: the TF32 column's shape dependence
    is noisier (4096^3 above every larger shape) and its level is carried by `TF32_EFFICIENCY` instead.
    """
    num, den = _weighted_corrections(m, n, k)
    factor = _physical(m, n, k, sms) * num / den
    align = kd.ALIGN_BYTES // itemsize
    if n % align or k % align:
        factor *= kd.MISALIGNED_GEMM_FACTOR
    return min(1.0, factor)


def gemm_rate(gpu, dtype: str, allow_tf32: bool) -> float:
    """Large-GEMM FLOP/s for matmuls in `dtype` through a long step: peak x the fraction a large GEMM
    reaches in its benchmark x the GPU's sustained derating (`profiles.Sustained`)."""
    return _benchmark_gemm_rate(gpu, dtype, allow_tf32) * gpu.sustained.compute


def _benchmark_gemm_rate(gpu, dtype: str, allow_tf32: bool) -> float:
    if dtype == "fp32":
        if allow_tf32 and "tf32" in gpu.peak_flops:
            return gpu.peak_flops["tf32"] * kd.TF32_EFFICIENCY.get(gpu.arch, gpu.matmul_efficiency)
        return gpu.peak_flops["fp32"] * kd.FP32_EFFICIENCY
    if dtype == "fp8":  # torchao Float8Linear's torch._scaled_mm (the profile's efficiency is bf16's)
        eff = gpu.fp8_matmul_efficiency or kd.FP8_EFFICIENCY.get(gpu.arch, gpu.matmul_efficiency)
        return gpu.flops("fp8") * eff
    return gpu.flops(dtype) * gpu.matmul_efficiency


def gemm_time(gpu, m: int, n: int, k: int, dtype: str, allow_tf32: bool = False) -> float:
    itemsize = {"fp32": 4, "fp8": 1}.get(dtype, 2)
    return 2.0 * m * n * k / (gemm_rate(gpu, dtype, allow_tf32) * gemm_shape_factor(m, n, k, gpu.sm_count, itemsize))


# ---- attention ------------------------------------------------------------------------------------------
def _by_seq(row: tuple, s: int) -> float:
    """Log-linear interpolation over the tables' sequence lengths, clamped at both ends."""
    seqs = kd.ATTENTION_SEQS
    x = math.log2(min(max(s, seqs[0]), seqs[-1]))
    i = min(int(x - math.log2(seqs[0])), len(seqs) - 2)
    t = x - math.log2(seqs[i])
    return row[i] * (1 - t) + row[i + 1] * t


def _by_head_dim(table: dict, d: int, causal: bool | None, s: int) -> float:
    """Linear in head dim between the 64 and 128 columns, clamped outside them."""
    t = min(max((d - 64) / 64, 0.0), 1.0)
    key = (lambda hd: hd) if causal is None else (lambda hd: (hd, causal))
    return _by_seq(table[key(64)], s) * (1 - t) + _by_seq(table[key(128)], s) * t


def _fwd_bwd_tflops(backend: str, table_arch: str, d: int, s: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) TFLOPS on the GPU the table was measured on."""
    if backend == "eager":
        fb = _by_head_dim(kd.EAGER_H100_FWD_BWD if table_arch == "sm90" else kd.EAGER_A100_FWD_BWD, d, causal, s)
        return fb, fb
    if backend == "cudnn":
        fwd = _by_head_dim(kd.CUDNN_H100_FWD, d, causal, s)
        bwd = _by_head_dim(kd.CUDNN_H100_BWD_NONCAUSAL, d, None, s)
        if causal:  # no causal backward figure: the forward's causal / non-causal ratio, assumed
            bwd *= fwd / _by_head_dim(kd.CUDNN_H100_FWD, d, False, s)
        return fwd, bwd
    if backend == "flash1":  # only fwd+bwd measured: both at that rate
        if table_arch == "sm80":
            fb = _by_head_dim(kd.FA1_A100_FWD_BWD, d, causal, s)
        else:  # no causal H100 figure: the A100's causal / non-causal ratio at that length, assumed
            fb = _by_head_dim(kd.FA1_H100_FWD_BWD_NONCAUSAL, d, False, s)
            if causal:
                fb *= _by_head_dim(kd.FA1_A100_FWD_BWD, d, True, s) / _by_head_dim(kd.FA1_A100_FWD_BWD, d, False, s)
        return fb, fb
    if table_arch == "sm90":
        fb, fwd = _by_head_dim(kd.FA2_H100_FWD_BWD, d, causal, s), _by_head_dim(kd.FA2_H100_FWD, d, causal, s)
        # backward from fwd+bwd and fwd: 3.5 F / T_fb = F / T_f + 2.5 F / T_b
        return fwd, 2.5 / (3.5 / fb - 1.0 / fwd)
    fb = _by_head_dim(kd.FA2_A100_FWD_BWD, d, causal, s)  # A100: only fwd+bwd measured; both at that rate
    return fb, fb


def attention_tflops(gpu, backend: str, d: int, s: int, causal: bool, peak: float | None = None) -> tuple[float, float]:
    """(forward, backward) FLOP/s of an attention kernel on `gpu` through a long step, at the fraction of the
    16-bit peak its table measured (sm90 tables for Hopper/Blackwell, sm80 for the rest) times `peak`, the
    peak of the dtype it runs in (default: this GPU's bf16 peak, which makes a GPU's own table exact),
    derated as any compute-bound kernel is (`profiles.Sustained`: tensor cores at the settled clock)."""
    table_arch = "sm90" if gpu.arch in ("sm90", "sm100") or backend == "cudnn" else "sm80"
    fwd, bwd = _fwd_bwd_tflops(backend, table_arch, d, s, causal)
    table_peak = kd.H100_BF16_PEAK if table_arch == "sm90" else kd.A100_BF16_PEAK
    peak = gpu.flops("bf16") if peak is None else peak
    scale = 1e12 * peak / table_peak
    # never above the GPU's own large-GEMM rate: attention's FLOPs are matmuls on the same tensor cores (a
    # GPU whose GEMMs reach less of its peak than the table's GPU did, MI300X's 51 %, or a power-capped part)
    ceiling = gpu.matmul_efficiency * peak
    derate = gpu.sustained.compute
    return min(fwd * scale, ceiling) * derate, min(bwd * scale, ceiling) * derate


# ---- memory-bound ---------------------------------------------------------------------------------------
def _log_interp(points: tuple, x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1]


@dataclass(frozen=True, slots=True)
class EagerFractions:
    """What eager kernels of one kind reach on one GPU generation: (size key, fraction of HBM peak) points,
    where they were measured, and whether they are that generation's own (False: another generation's
    figure stands in, and `source` names the gap)."""

    points: tuple[tuple[float, float], ...]
    source: str
    own: bool


@cache
def eager_memory(kind: str, arch: str) -> EagerFractions:
    """The eager fractions of HBM peak for `kind` on the generation `arch`: its own measurement where one
    exists, else H100's (`kd.FALLBACK_ARCH`), else the one generation's that was measured."""
    measured = kd.EAGER_MEMORY[kind]
    if arch in measured:
        return EagerFractions(*measured[arch], own=True)
    gen = fallback_generation(kind)
    points, source = measured[gen]
    return EagerFractions(points, f"gap: no {arch} measurement, {kd.GENERATIONS[gen]}'s: {source}", own=False)


def fallback_generation(kind: str) -> str:
    """The generation whose eager figure for `kind` stands in where a GPU's own was not measured: H100's,
    else the first listed in `kd.EAGER_MEMORY` (rotary, measured on A100 and B200, takes A100's)."""
    measured = kd.EAGER_MEMORY[kind]
    return kd.FALLBACK_ARCH if kd.FALLBACK_ARCH in measured else next(iter(measured))


def memory_efficiency(kind: str, kernel_shape: tuple, nbytes: float, fused: bool, arch: str) -> float:
    """Fraction of HBM peak a memory-bound kernel of `kind` reaches on generation `arch`: under
    `torch_compile` the fused kernel's (measured on H100 only), else the eager one's for that generation."""
    points = kd.FUSED_MEMORY[kind] if fused and kind in kd.FUSED_MEMORY else eager_memory(kind, arch).points
    key = nbytes if kind == "elementwise" or not kernel_shape else kernel_shape[-1]
    return _log_interp(points, key)


# ---- a module's kernels ----------------------------------------------------------------------------------
@dataclass(slots=True)
class KernelTimes:
    """Seconds of GPU time by class, and the kernels launched (for the CPU issue thread)."""

    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    launches: int = 0

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.memory


def kernels_time(gpu, kernels: tuple[Kernel, ...], pass_: str, dtype: str, options: ComputeOptions) -> KernelTimes:
    """GPU time of `kernels` run as `pass_`: forward, backward, or recompute (forward up to the last saved tensor)."""
    out = KernelTimes()
    backward = pass_ == "backward"
    backend = select_sdpa_backend(gpu.arch, options)
    for k in kernels:
        if pass_ == "recompute" and not k.recompute:
            continue
        if k.kind == "gemm":
            m, n, kk = k.shape
            gemm_dtype = k.dtype or dtype  # a float8 Linear's GEMMs run in fp8 (workload/float8.py)
            t = gemm_time(gpu, m, n, kk, gemm_dtype, options.allow_tf32)
            if backward:  # input gradient (m, k, n), when the input needs one, and weight gradient (n, k, m)
                t = gemm_time(gpu, n, kk, m, gemm_dtype, options.allow_tf32) if k.weight_grad else 0.0
                if k.input_grad:
                    t += gemm_time(gpu, m, kk, n, gemm_dtype, options.allow_tf32)
            out.matmul += t
            out.launches += k.bwd_launches if backward else k.launches
        elif k.kind in ("attention", "attention_eager"):
            b, h, s, d = k.shape
            if dtype == "fp32":  # flash and cuDNN take 16-bit inputs only: SDPA falls back to its math path,
                # assumed to run at the standard-attention fraction of the fp32 matmul peak
                fwd, bwd = attention_tflops(gpu, "eager", d, s, k.causal, gpu.matmul_peak("fp32", options.allow_tf32))
            else:
                fwd, bwd = attention_tflops(gpu, "eager" if k.kind == "attention_eager" else backend, d, s, k.causal)
            flops = 4.0 * b * h * s * s * d * (0.5 if k.causal else 1.0)  # as the tables count them
            out.attention += 2.5 * flops / bwd if backward else flops / fwd
            out.launches += k.bwd_launches if backward else k.launches
        else:
            nbytes = k.bwd_bytes if backward else k.bytes
            eff = memory_efficiency(k.kind, k.shape, nbytes, options.torch_compile, gpu.arch)
            out.memory += nbytes / (gpu.memory_Bps * eff)
            launches = k.bwd_launches if backward else k.launches
            out.launches += min(launches, 1) if options.torch_compile else launches
    return out


def launch_cost_s(backward: bool, options: ComputeOptions) -> float:
    """Host time the CPU issue thread spends per kernel launch."""
    if options.torch_compile:
        return kd.COMPILED_LAUNCH_S
    return kd.EAGER_BACKWARD_LAUNCH_S if backward else kd.EAGER_FORWARD_LAUNCH_S


def elementwise_time(gpu, nbytes: float) -> float:
    """A plain copy / cast / foreach pass of `nbytes` at the eager elementwise efficiency for its size on
    the GPU's generation."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (gpu.memory_Bps * _log_interp(eager_memory("elementwise", gpu.arch).points, nbytes))
