"""The software stack a run assumes, decided by one knob: `compute.torch_version`.

A torch release fixes more than its SDPA backend order (kernels.py `select_sdpa_backend`: FlashAttention-1
before 2.2, FlashAttention-2 after, cuDNN first on Hopper and Blackwell from 2.9 but 2.10). It ships an
NCCL, whose tuner and buffers changed between versions, and its `nn.RMSNorm` / `F.rms_norm` became one
fused CUDA kernel only once `aten::_fused_rms_norm` landed. Each of those is read here from the version,
so that a scenario written for a December 2024 torchtitan run (torch 2.6) prices what that run ran.
`model.norm_impl` and `compute.sdpa_backend` stay as overrides.

Not decided by the version here: Inductor's fusion under `torch_compile` is torch 2.13's for every
release (workload/compiled_block.py, read from the 2.13 wheel's Inductor; the fusion groups of a
Llama block -- norm with residual add, SiLU x mul, the GQA repeat, complex RoPE left eager -- are
older than the releases the tool covers, and no per-release fusion listing was read), priced at
kernel_data's Inductor bandwidths, measured on torch 2.7.1 and a 2026 nightly.
"""

from __future__ import annotations

import bisect

# The NCCL the torch wheels pin (nvidia-nccl-cu12 in pip logs and freezes of public repositories [C28]):
# 2.3 and 2.4 -> 2.20.5, 2.5 and 2.6 -> 2.21.5, 2.7 -> 2.26.2, 2.8 -> 2.27.3 (component-timing 6.1),
# 2.9 and 2.10 -> 2.27.5, 2.11 -> 2.28.9 ("torch 2.11 needs NCCL 2.28.9+") [C28]. Later releases: assumed
# 2.28.9, the newest sourced pin. Earlier than 2.3: assumed 2.20.5's behaviour (no older pin is read here).
TORCH_NCCL = (((2, 3), (2, 20, 5)), ((2, 5), (2, 21, 5)), ((2, 7), (2, 26, 2)), ((2, 8), (2, 27, 3)),
              ((2, 9), (2, 27, 5)), ((2, 11), (2, 28, 9)))
# aten::_fused_rms_norm (pytorch/pytorch PR #153666, merged July 2025 [I13]) is first in torch 2.9; up to 2.8
# `nn.RMSNorm` runs the composite of eager ops HF's LlamaRMSNorm runs (in-situ.md 6)
FUSED_RMS_NORM_FROM = (2, 9)
# NCCL <= 2.20 sizes NVLS buffers nCh x 2 x (4 + 2) MiB per rank: 2.25 GiB per GPU logged on 8x H200
# (hardware.md 5.2 [S5, S19]); 2.21 and later 1 MiB x 16 channels x 2 x 8 heads = 256 MiB on Hopper, the
# figure the Hopper profiles' nccl_bytes include
NVLS_BUFFERS_BEFORE_2_21 = 9 << 28  # 2.25 GiB
NVLS_BUFFERS_HOPPER = 256 << 20
# the ring all-reduce's network steps in NCCL's tuner: 2 x nNodes in 2.21.5, 2 x (nNodes - 1) from 2.26
# (component-timing 6.2 [C27]); 2.20.5 taken as 2.21.5 (assumed: the oldest tuner read)
AR_INTER_STEPS_FIXED_IN = (2, 26)


def nccl_version(torch_version: tuple[int, ...]) -> tuple[int, int, int]:
    """The NCCL the torch release `torch_version` ships."""
    keys = [t for t, _ in TORCH_NCCL]
    i = bisect.bisect_right(keys, tuple(torch_version[:2])) - 1
    return TORCH_NCCL[max(i, 0)][1]


def rms_norm_kernel(torch_version: tuple[int, ...]) -> str:
    """`model.norm_impl`'s default: "fused" (one `_fused_rms_norm` kernel) from torch 2.9, else "composite"."""
    return "fused" if tuple(torch_version[:2]) >= FUSED_RMS_NORM_FROM else "composite"


def ring_all_reduce_inter_steps(nodes: int, nccl: tuple[int, ...]) -> int:
    """Network steps NCCL's tuner counts for a ring all-reduce across `nodes` nodes."""
    return 2 * (nodes - 1) if nccl >= AR_INTER_STEPS_FIXED_IN else 2 * nodes


def nccl_buffer_bytes(gpu, nccl: tuple[int, ...]) -> int:
    """NCCL's buffers per process group: the profile's figure (NCCL >= 2.21's NVLS buffers on a Hopper
    NVLS node), with NCCL <= 2.20's 2.25 GiB of NVLS buffers in place of 256 MiB where it applies."""
    if nccl < (2, 21) and gpu.arch == "sm90" and gpu.fabric.nvls is not None:
        return gpu.nccl_bytes - NVLS_BUFFERS_HOPPER + NVLS_BUFFERS_BEFORE_2_21
    return gpu.nccl_bytes


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


NORM_KERNELS = {"fused": "one fused kernel", "composite": "composite of eager ops", "hf_llama": "HF LlamaRMSNorm (eager ops)"}


def stack(options, sdpa_backend: str, norm_impl: str | None, compiled_blocks: str | None = None) -> dict:
    """What the run assumes of its software, for the results: torch, the NCCL it ships, the SDPA backend it
    picks on the GPU (kernels.py `select_sdpa_backend`), the norms' kernel (LayerNorm's is always fused; None: a workload that does not say)
    and whether Inductor compiles; under torch.compile, how the blocks are priced (workload/compiled_block.py
    `compiled_note`: Inductor's table, or the approximation and why)."""
    return {"torch": version_text(options.torch_version), "nccl": version_text(nccl_version(options.torch_version)),
            "sdpa_backend": sdpa_backend,
            "norm": NORM_KERNELS.get(norm_impl) if norm_impl else None,
            "torch_compile": options.torch_compile,
            **({"compiled_blocks": compiled_blocks} if options.torch_compile and compiled_blocks else {})}
