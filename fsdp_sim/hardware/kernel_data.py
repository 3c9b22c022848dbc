"""Measured kernel throughputs the compute model interpolates, each table with its source beside it.

Source keys ([C#], [S#]) are listed with their public sources in hardware_profiles/README.md ("Source keys").
Nothing here is fitted to a whole-model training throughput: every figure is a single-kernel measurement.
"""

from __future__ import annotations

# ---- GEMM ------------------------------------------------------------------------------------------
# XLA's measured H100 (sm_90, SXM-class) matmul table, median of 5 kernel runs, FLOPs = 2*b*m*n*k
# [C2 matmul_interpolator_data.h, component-timing §1.2]: (b*m, n, k) -> (bf16 TFLOPS, f32-as-TF32 TFLOPS).
# The batch dimension is folded into the token dimension, as the reference reads it.
H100_GEMM_TABLE: tuple[tuple[int, int, int, float, float], ...] = (
    (512, 256, 256, 11.5, 9.7),
    (256, 1024, 4096, 172.3, 73.1),
    (256, 4096, 4096, 412.0, 177.8),
    (1024, 1024, 2048, 350.0, 160.4),
    (2048, 2048, 2048, 632.0, 329.2),
    (4096, 1024, 1024, 488.1, 259.1),
    (4096, 1024, 4096, 738.5, 291.1),
    (8192, 1024, 4096, 750.6, 306.2),
    (16384, 1024, 4096, 777.6, 310.1),
    (4096, 512, 4096, 650.0, 315.6),
    (8192, 512, 4096, 729.7, 223.3),
    (4096, 4096, 256, 392.2, 184.0),
    (4096, 4096, 512, 543.1, 235.0),
    (4096, 4096, 2048, 738.7, 325.0),
    (4096, 4096, 4096, 783.3, 401.6),
    (8192, 4096, 4096, 807.7, 340.1),
    (16384, 4096, 4096, 793.1, 346.9),
    (16384, 2048, 4096, 808.7, 339.6),
)
H100_GEMM_SMS = 132  # the SM count the table was measured with (H100 SXM) [C1 §1.5]
# The table's K series at m = n = 4096 (K 256 / 512 / 2048 / 4096), relative to K = 4096 [C2]
GEMM_K_SERIES = ((256, 392.2 / 783.3), (512, 543.1 / 783.3), (2048, 738.7 / 783.3), (4096, 1.0))
# output tiles the library picks among for wave quantisation: 128x256 (the Llama-3.1-8B up-proj example,
# [C1 §1.5]), its transpose, and 128x128 (NVIDIA's Matrix Multiplication Background guide, via [C1])
GEMM_TILES = ((128, 256), (256, 128), (128, 128))
# A misaligned GEMM dimension (not a multiple of 128 bytes, 64 bf16 elements, on A100/H100 [C1 §1.5]):
# SwiGLU MLP at h=4096 on H100, d_ff 10922 -> 272.7 TFLOPS against 10944 -> 398.4 [C1 training/performance]
MISALIGNED_GEMM_FACTOR = 272.7 / 398.4
ALIGN_BYTES = 128
# Fraction of the TF32 peak a large fp32 matmul reaches with TF32 on: A100 10240^3 in 0.016 s = 134 of 156
# TFLOPS [C6 PyTorch docs cuda.rst]; H100 4096^3 401.6 of 494.7 [C2]. Without TF32 the A100 ran 10240^3 in
# 0.11 s = 19.5 TFLOPS, 100 % of the fp32 (non-tensor-core) peak [C6]: assumed on every other GPU (no measurement).
TF32_EFFICIENCY = {"sm80": 134.0 / 156.0, "sm90": 401.6 / 494.7}
FP32_EFFICIENCY = 1.0
# Fraction of the fp8 (e4m3) dense peak the best-shaped `torch._scaled_mm` reaches (MAMF): H100 SXM 1,402.6 of
# 1,979 TFLOPS, H200 1,453.4 (the same sm90 part: H100's figure), B200 3,432 of 4,500 [S7] (component-timing 1.1,
# hardware.md 2); an fp8 GEMM's shape then counts as a bf16 one's
FP8_EFFICIENCY = {"sm90": 1402.6 / 1978.9, "sm100": 3432.0 / 4500.0}

# ---- attention ---------------------------------------------------------------------------------------
# TFLOPS by sequence length (512, 1k, 2k, 4k, 8k, 16k), FLOPs counted as flash-attention's benchmark counts
# them: forward 4*b*s^2*h*d, halved when causal, backward 2.5x forward [C9 benchmark_flash_attention.py].
ATTENTION_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
# FlashAttention-2 fwd+bwd, A100 80GB SXM4 [C9 flash2_a100_fwd_bwd_benchmark.png, component-timing §2.2]
FA2_A100_FWD_BWD = {(64, False): (132, 153, 162, 171, 175, 176), (128, False): (151, 173, 187, 196, 201, 203),
                    (64, True): (88, 119, 140, 156, 165, 171), (128, True): (99, 133, 155, 173, 182, 189)}
# FlashAttention-2 fwd+bwd, H100 80GB SXM5 [C9 flash2_h100_fwd_bwd_benchmark.png, §2.3]
FA2_H100_FWD_BWD = {(64, False): (215, 254, 274, 288, 294, 296), (128, False): (248, 294, 320, 326, 335, 338),
                    (64, True): (141, 192, 232, 257, 273, 284), (128, True): (163, 221, 265, 294, 308, 328)}
# Forward only, H100 SXM5, FP16: FA2 and cuDNN columns of the FA3 paper's forward figure [C9 flash3_fp16_fwd.png, §2.4]
FA2_H100_FWD = {(64, False): (282, 306, 318, 321, 322, 324), (64, True): (180, 229, 262, 284, 295, 299),
                (128, False): (309, 350, 362, 368, 370, 370), (128, True): (191, 260, 298, 319, 333, 335)}
CUDNN_H100_FWD = {(64, False): (335, 373, 395, 408, 412, 413), (64, True): (225, 288, 334, 363, 379, 388),
                  (128, False): (497, 574, 617, 609, 600, 595), (128, True): (315, 410, 484, 518, 529, 539)}
# Backward only, H100 SXM5, FP16, non-causal: cuDNN column of the FA3 paper's backward figure [C12, §2.5]
CUDNN_H100_BWD_NONCAUSAL = {64: (266, 348, 395, 417, 432, 433), 128: (305, 408, 465, 499, 518, 516)}
# FlashAttention-1 fwd+bwd, the FA1 bars of the same FA2 figures: A100 80GB SXM4 with and without the causal
# mask, H100 80GB SXM5 non-causal only [C9 flash2_a100 / flash2_h100 benchmark figures, §2.2-2.3]. SDPA's
# FLASH backend before torch 2.2 ("SDPA now supports FlashAttention-2, yielding around 2x speedups
# compared to previous versions": the 2.2 release, [F7]) and the flash-attn 1.x package
FA1_A100_FWD_BWD = {(64, False): (91, 92, 104, 108, 110, 110), (128, False): (76, 72, 76, 80, 82, 83),
                    (64, True): (58, 70, 77, 87, 92, 97), (128, True): (55, 62, 69, 76, 80, 83)}
FA1_H100_FWD_BWD_NONCAUSAL = {(64, False): (157, 159, 161, 161, 166, 168), (128, False): (127, 127, 128, 131, 137, 139)}
# PyTorch standard (explicit-scores) attention fwd+bwd; OOM at 16k, where the 8k figure is repeated
# [C9 flash2_a100 / flash2_h100 benchmark figures, §2.2-2.3]
EAGER_A100_FWD_BWD = {(64, False): (36, 40, 43, 45, 46, 46), (128, False): (53, 67, 76, 79, 86, 86),
                      (64, True): (15, 16, 17, 18, 18, 18), (128, True): (23, 28, 32, 32, 34, 34)}
EAGER_H100_FWD_BWD = {(64, False): (62, 72, 81, 86, 87, 87), (128, False): (93, 120, 145, 160, 167, 167),
                      (64, True): (26, 29, 31, 32, 32, 32), (128, True): (40, 50, 57, 61, 63, 63)}
# The peaks those were measured against, to carry a fraction of peak to a GPU with no table of its own
A100_BF16_PEAK, H100_BF16_PEAK = 312.0e12, 989.4e12  # [S7]

# ---- memory-bound kernels ----------------------------------------------------------------------------
# Achieved fraction of HBM peak on ideal bytes (each input read, each output written once), eager PyTorch,
# as (size key, fraction) points; the key is the row width (hidden / ffn) or, for `elementwise`, bytes moved.
# Liger-Kernel's benchmark CSV [C5 all_benchmark_data.csv, component-timing §3.2] and TileOPs [C18, §3.3].
# By GPU generation (a profile's `arch`), each with where it was measured: a generation without a
# measurement of a kind takes FALLBACK_ARCH's (H100's) figure, or, for a kind H100 was not measured on, the
# one generation's that was, and says so (kernels.py `eager_memory`).
FALLBACK_ARCH = "sm90"
GENERATIONS = {"sm80": "A100", "sm90": "H100/H200", "sm100": "B200", "gfx942": "MI300X"}
# eager elementwise by bytes moved: H200 torch.maximum 25 / 63 / 126 MB at 38 / 58 / 70 % [C18 TileOPs#512];
# device memcpy on A100-40GB 85.5 % (FlagPerf) [S22], taken at 1 GB (transfer size not stated: assumed).
# One curve from two generations: H100/H200 has no large-copy point, A100 no small-size one (both gaps).
_ELEMENTWISE = ((25e6, 0.38), (63e6, 0.58), (126e6, 0.70), (1e9, 0.855))
# MI300X against H100 on one eager kernel timed by the same script, torch.sum of 2^30 fp32 (4.3 GB) after
# ROCm's reduce fix (torch 2.5): 3,205 GB/s of 5,300 on MI300X, 3,136 of 3,350 on H100 SXM [E1 pytorch#135397]
MI300X_VS_H100_ELEMENTWISE = (3205 / 5300) / (3136 / 3350)  # 0.646
EAGER_MEMORY = {
    "norm": {
        # torch.nn.RMSNorm fwd bf16, H100, 4096 rows: 4096 wide 2.07 TB/s (62 %), 16384 wide 1.80 TB/s (54 %) [C5]
        "sm90": (((4096, 0.62), (16384, 0.54)), "torch.nn.RMSNorm fwd bf16 on H100 [C5]"),
        # nn.LayerNorm fwd fp32, A100-80GB, 4096 rows (ideal 8 B a value): 4096 wide 0.1218 ms = 1.10 TB/s
        # (54.0 %), 16384 wide 0.5067 ms = 1.06 TB/s (52.0 %) [C5]; A100's native fused norm (no fused RMSNorm
        # measured on A100); on H100 the same LayerNorm benchmark and RMSNorm agree at 16384 (52 vs 54 %) [C5]
        "sm80": (((4096, 0.540), (16384, 0.520)), "nn.LayerNorm fwd fp32 on A100-80GB [C5]"),
    },
    # HF LlamaRMSNorm fwd bf16, A100-80GB: 2048x4096 6 %, 2048x32768 0.14 TB/s (7 %) [C5]
    "norm_unfused": {"sm80": (((4096, 0.06), (32768, 0.07)), "HF LlamaRMSNorm fwd bf16 on A100-80GB [C5]")},
    "rope": {
        # HF rotary embedding fwd, A100-80GB, s=2048, 32 q / 8 kv heads, hidden 8192: 0.517 ms for ~84 MB
        # (q and k read and written once, batch 1 assumed) = 162 GB/s, 8 % of 2,039 [C5; calc]
        "sm80": (((8192, 0.08),), "HF rotate_half rotary embedding fwd on A100-80GB [C5]"),
        # eager rotate_half RoPE on q and k (4, 2048, 32, 128) bf16, B200: 8.675 ms for 10 iterations, 100
        # launches; 268 MB ideal (q and k read and written once) in 0.8675 ms = 309 GB/s, 3.9 % of 8.0 TB/s
        # [E2 pytorch#176223; calc]; q + k width 8192, the key of A100's point
        "sm100": (((8192, 0.0387),), "eager rotate_half RoPE fwd bf16 on B200 [E2]"),
    },
    # eager silu(a) * b fwd bf16, H100, 8192 tokens: ffn 4096 1.02 TB/s (30 %), ffn 32768 1.08 TB/s (32 %) [C5]
    # (Liger's A100 swiglu / geglu rows time the whole MLP, GEMMs included: no A100 figure for the activation)
    "activation": {"sm90": (((4096, 0.30), (32768, 0.32)), "eager silu(a)*b fwd bf16 on H100 [C5]")},
    # HF cross-entropy fwd on fp32 logits, A100-80GB, 16384 x 131072: 20.7 ms for 17.2 GB = 41 % [C5; calc]
    "cross_entropy": {"sm80": (((131072, 0.41),), "HF cross-entropy fwd fp32 on A100-80GB [C5]")},
    "elementwise": {
        "sm90": (_ELEMENTWISE, "torch.maximum on H200 to 126 MB [C18]; above, A100's memcpy [S22] (gap)"),
        "sm80": (_ELEMENTWISE, "memcpy on A100-40GB at 1 GB [S22]; below 126 MB, H200's torch.maximum [C18] (gap)"),
        "gfx942": (tuple((x, f * MI300X_VS_H100_ELEMENTWISE) for x, f in _ELEMENTWISE),
                   "H100/H200 curve x 0.646, MI300X vs H100 torch.sum 4.3 GB [E1] (the ratio assumed at every size)"),
    },
}
# What Inductor's generated kernels reach, for the kernels a compiled block runs (workload/compiled_block.py).
# Reductions by row width: torch.compile 2.7.1 RMSNorm bf16 on H100 (3,350 GB/s): 32K x 4K ~2,300, 32K x 16K
# ~1,800, 16K x 131K ~1,500 GB/s [C17 Quack benchmark figure, component-timing 3.1]; no figure for the backward's
# reductions: taken alike. Pointwise: torch.compile's one rotate_half RoPE kernel on q and k, B200, (4, 2048, 32,
# 128) bf16, 0.047 ms for q and k read and written once (268 MB) = 5.71 TB/s of 8.0 [in-situ 6, src R pytorch PR
# #176223; calc]. Measured on 2.7.1 and a 2026 nightly: the same figures for every release (hardware/software.py)
INDUCTOR_REDUCTION = ((4096, 0.69), (16384, 0.537), (131072, 0.448))
INDUCTOR_POINTWISE = ((1, 4 * 2048 * 32 * 128 * 2 * 4 / 0.047e-3 / 8.0e12),)
# What a fused kernel reaches (torch.compile where measured, else the fused Triton kernel of the same op)
FUSED_MEMORY = {
    "norm": INDUCTOR_REDUCTION,
    "norm_unfused": INDUCTOR_REDUCTION,
    # Liger fused RoPE, A100: 0.060 ms for the same ~84 MB = 1.4 TB/s, 69 % [C5; calc] (Inductor assumed alike)
    "rope": ((8192, 0.69),),
    # Liger fused SwiGLU fwd, H100, 8192 tokens: ffn 4096 2.78 TB/s (83 %), ffn 32768 3.05 TB/s (91 %) [C5]
    # (component-timing 3.2; Inductor assumed alike)
    "activation": ((4096, 0.83), (32768, 0.91)),
    # torch.compile 2.7.1 cross-entropy fp32 32K x 32K ~3,150 GB/s of 3,350 [C17]; taken for bf16 logits
    # too, where it measured ~1,700 (32K) and ~1,230 (131K) GB/s (component-timing 3.1): not told apart
    "cross_entropy": ((32768, 0.94),),
    "inductor_reduction": INDUCTOR_REDUCTION,
    "inductor_pointwise": INDUCTOR_POINTWISE,
}  # a plain copy (`elementwise`) stays the eager kernel under torch.compile
# a compiled block's kernels are Inductor's whether or not the options say compile (a saved workload)
EAGER_MEMORY |= {
    "inductor_reduction": {"sm90": (INDUCTOR_REDUCTION, "torch.compile 2.7.1 RMSNorm bf16 on H100 [C17]")},
    "inductor_pointwise": {"sm100": (INDUCTOR_POINTWISE, "one compiled rotate_half RoPE kernel on B200 [R]")},
}

# ---- host (CPU) cost per kernel launch ------------------------------------------------------------------
EAGER_FORWARD_LAUNCH_S = 8e-6  # eager `add` on A100, submit only: 8 us per op (Python + dispatcher + launch) [C22 FlagGems PR]
EAGER_BACKWARD_LAUNCH_S = 5e-6  # ~5 us per launch API inside a traced eager model (autograd's C++ engine) [C22 vllm-omni PR #6516]
COMPILED_LAUNCH_S = 6.8e-6  # Inductor per-kernel launch (CachingAutotuner.run, no args), GB200 [C21 tritonbench PR #1017]
