"""torchao float8 training (`convert_to_float8_training`, tensorwise dynamic scaling) as torchtitan applies it.

Which Linears: torchtitan swaps every `nn.Linear` for `Float8Linear` except those its `filter_fqns` names
(default `["output"]`: the LM head stays bf16) and those whose in and out features are not multiples of 16
(`torch._scaled_mm`'s alignment; torchtitan's filter skips them). Embeddings and norms stay bf16.

What a Float8Linear runs (torchao `float8/float8_linear.py`, `matmul_with_hp_or_float8_args`):
- its three GEMMs (output, input gradient, weight gradient) in `torch._scaled_mm`, at the fp8 rate;
- dynamic scaling casts, memory-bound kernels (`hp_tensor_to_float8_dynamic`: an amax reduction that reads
  the tensor, then a scale-and-cast that reads it again and writes one byte per element): forward the input,
  and the weight unless FSDP all-gathered it in float8 already (`tensor_already_casted_to_fp8`); backward
  the output gradient, the input again and the weight again (it saved them in high precision), and the
  transposed copies `_scaled_mm` needs (the second operand column-major: the weight for the input gradient,
  the output gradient and the input for the weight gradient; one byte read and written each);
- what it saves for backward: `ctx.save_for_backward(input_hp, weight_hp_t)`, the high-precision input (what
  a bf16 Linear saves anyway) and the weight as it arrived (the unsharded parameter, in float8 when FSDP
  all-gathered it so): no activation bytes beyond a bf16 Linear's; the fp8 copies are temporaries.

Under tensor parallel torchtitan's plan casts a Linear's input before the module sees it (torchao
`float8_tensor_parallel.py`): `PrepareFloat8ModuleInput` casts the attention's and the MLP's input once,
on this rank's sequence shard with sequence parallel, before the all-gather (wk / wv / w3 take wq's / w1's
cast, `tensor_already_casted_to_fp8`), and `Float8RowwiseParallel` casts wo's and w2's sharded input.
A Linear whose input arrives in float8 saves that float8 tensor, so its backward does not cast the input
again. Not modelled: that the saved inputs are then float8 (the activation bytes stay a bf16 Linear's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_sim.datafile import expect_mapping, get_key, reject_unknown_keys
from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.model import Kernel, Workload

FILTER_FQNS = ("output",)  # torchtitan's default `float8.filter_fqns`: the LM head is not converted
SCALED_MM_ALIGN = 16  # in and out features must be multiples of 16 for torch._scaled_mm
AMAX_AND_CAST_BYTES = 2 + 2 + 1  # per element of a bf16 tensor: amax reads 2, scale-and-cast reads 2, writes 1
TRANSPOSE_BYTES = 1 + 1  # per element of an fp8 tensor made column-major: read 1, write 1
CAST_LAUNCHES = 2  # amax (abs + max reduction, fused) and the scale-and-cast kernel, eager


@dataclass(frozen=True, slots=True)
class Float8:
    """`compute.float8`: enabled, `enable_fsdp_float8_all_gather`, `precompute_float8_dynamic_scale_for_fsdp`."""
    enabled: bool = False
    fsdp_float8_all_gather: bool = False
    precompute_scale: bool = False


def parse_float8(raw, gpu, reshard_after_forward: bool | int = True) -> Float8:
    """`compute.float8`: refused on a GPU without fp8 tensor cores (torch._scaled_mm needs sm89 or later), and
    the float8 all-gather beside an hpZ `reshard_after_forward` (its post-forward copies are not modelled in fp8)."""
    raw = expect_mapping("compute.float8", raw)
    reject_unknown_keys("compute.float8", raw, {"enabled", "fsdp_float8_all_gather", "precompute_scale"})
    f8 = Float8(enabled=get_key("compute.float8", raw, "enabled", bool, bool(raw)),
                fsdp_float8_all_gather=get_key("compute.float8", raw, "fsdp_float8_all_gather", bool, False),
                precompute_scale=get_key("compute.float8", raw, "precompute_scale", bool, False))
    if not f8.enabled:
        return Float8()
    if "fp8" not in gpu.peak_flops:
        raise ScenarioError(f"compute.float8.enabled: {gpu.name} has no fp8 tensor cores (torch._scaled_mm needs "
                            "compute capability 8.9 or later: Ada, Hopper, Blackwell)")
    if f8.precompute_scale and not f8.fsdp_float8_all_gather:
        raise ScenarioError("compute.float8.precompute_scale: needs fsdp_float8_all_gather: true (it precomputes "
                            "the scales FSDP's float8 all-gather casts with)")
    if f8.fsdp_float8_all_gather and not isinstance(reshard_after_forward, bool):
        raise ScenarioError("compute.float8.fsdp_float8_all_gather: not modelled with fsdp.reshard_after_forward "
                            f"as a group size ({reshard_after_forward}); use true or false")
    return f8


def _converted(k: Kernel) -> bool:
    if k.kind != "gemm" or k.name in FILTER_FQNS:
        return False
    _, n, kk = k.shape
    return n % SCALED_MM_ALIGN == 0 and kk % SCALED_MM_ALIGN == 0


COLWISE_FIRST = ("wq", "w1")  # under TP, the Linears whose module input PrepareFloat8ModuleInput casts
COLWISE_SHARED = ("wk", "wv", "w3")  # ... and those that read that cast


def _input_cast_rows(name: str, rows: int, tp: int, sequence_parallel: bool) -> tuple[int, bool]:
    """Rows of the input a Float8Linear casts in forward, and whether its backward casts it again: its own
    whole input without TP; under torchtitan's TP plan the module input once (the sequence shard with
    sequence parallel), nothing for the Linears sharing that cast, and no recast in backward."""
    if tp == 1:
        return rows, True
    if name in COLWISE_SHARED:
        return 0, False
    if name in COLWISE_FIRST and sequence_parallel:
        return rows // tp, False
    return rows, False


def _float8_linear(k: Kernel, weight_cast: bool, tp: int = 1, sequence_parallel: bool = True) -> tuple[Kernel, Kernel]:
    """A Float8Linear's casts (one memory-bound kernel, forward and backward traffic) and its fp8 GEMM."""
    m, n, kk = k.shape
    weight = n * kk * AMAX_AND_CAST_BYTES if weight_cast else 0
    rows, recast = _input_cast_rows(k.name, m, tp, sequence_parallel)
    fwd = rows * kk * AMAX_AND_CAST_BYTES + weight
    bwd = (m * n + (m * kk if recast else 0)) * AMAX_AND_CAST_BYTES + weight + (n * kk + m * n + m * kk) * TRANSPOSE_BYTES
    casts = Kernel(f"float8 casts ({k.name})", "elementwise", bytes=fwd, bwd_bytes=bwd,
                   launches=CAST_LAUNCHES * ((rows > 0) + weight_cast),
                   bwd_launches=CAST_LAUNCHES * (2 + recast + weight_cast) + 3, recompute=k.recompute)
    return casts, replace(k, dtype="fp8")


def float8_workload(wl: Workload, f8: Float8) -> tuple[Workload, frozenset[str]]:
    """The workload with its eligible Linears as Float8Linears, and the names of their weights."""
    if not f8.enabled:
        return wl, frozenset()
    weight_cast = not f8.fsdp_float8_all_gather
    tp, sp = wl.meta.get("tp", 1), wl.meta.get("sequence_parallel", True)
    converted: dict[int, tuple[Kernel, ...]] = {}  # one tuple per distinct kernel list: op pricing caches by it
    weights: set[str] = set()
    modules = []
    for m in wl.modules:
        names = {k.name for k in m.kernels if _converted(k)}
        if names:
            if id(m.kernels) not in converted:
                out: list[Kernel] = []
                for k in m.kernels:
                    out += _float8_linear(k, weight_cast, tp, sp) if _converted(k) else (k,)
                converted[id(m.kernels)] = tuple(out)
            weights |= {p.name for p in m.params if p.name.endswith(".weight") and p.name.split(".")[-2] in names}
            m = replace(m, kernels=converted[id(m.kernels)])
        modules.append(m)
    return replace(wl, modules=tuple(modules), meta=wl.meta | {"float8_linears": len(weights)}), frozenset(weights)
