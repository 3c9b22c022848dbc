"""Frozen parameters (`model.frozen`): `requires_grad_(False)` on the parameters a pattern names.

A frozen parameter gets no gradient (so no unsharded or sharded gradient, no reduce-scatter, no optimizer
state: the runtime keys all of these on `Param.trainable`) and is stored in its own dtype (nothing keeps an
fp32 master copy of a parameter nothing updates). Its module's backward changes as autograd runs it:
- a Linear whose weight needs no gradient runs no weight-gradient GEMM (`Kernel.weight_grad`), only the
  input gradient; an embedding whose weight is frozen runs no backward kernel at all;
- the derivative of `mm` saves its input only for the weight gradient (the generated autograd code guards
  each `SavedVariable` with `should_compute_output`; checked under `saved_tensors_hooks`: a frozen
  `nn.Linear` saves only its weight, which FSDP frees at reshard): a tensor only frozen Linears read is not
  kept. In the transformer block (`transformer.block_activations`) those are attention_norm's output (read
  by wq, wk, wv), ffn_norm's output (w1, w3) and w2's input; wo's input is SDPA's output, which SDPA keeps
  itself (eager attention's (b, s, .) copy only wo keeps). A frozen head keeps no input.
Patterns are `fnmatch` patterns over parameter names (`tok_embeddings.weight`, `layers.*.attention.wq.weight`)
or module prefixes of them (`tok_embeddings`, `layers.*.attention`).
"""

from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatchcase

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.workload.model import Kernel, Module, Param, Workload
from fsdp_sim.workload.transformer import (BLOCK_RECIPE, NORM_STAT_TENSORS, recipe_activations, recipe_gemm_shapes,
                                           weight_only_saves)

FROZEN_DTYPES = ("bf16", "fp16", "fp32")
# an adapter's kernels are named by its target Linear's kernel and these (`lora.py`)
LORA_DROPOUT, LORA_A, LORA_B, LORA_SCALE_ADD = " lora_dropout", " lora_A", " lora_B", " lora scale + add"
QUANT_STATE_SUFFIX = ".weight.absmax"  # a 4-bit weight's block scales, stored beside it (`lora.py`)
# Workload.meta: (the modules before the first freezing, the frozen dtype, the Linears whose input an adapter
# keeps), what `lora.autograd_view` re-freezes from when other parameters need gradients (FSDP1 use_orig_params)
UNFROZEN = "unfrozen"
# tensors of a pre-norm block that only Linears' weight gradients keep: (readers, the attention kind the
# rule needs or None) -> which `transformer.block_activations` line saved it
_INPUT_GROUPS = ((("wq", "wk", "wv"), None), (("w1", "w3"), None), (("w2",), None), (("wo",), "attention_eager"))


def matches(name: str, pattern: str) -> bool:
    """A parameter name matches a pattern naming it, or naming a module it is inside."""
    return fnmatchcase(name, pattern) or fnmatchcase(name, pattern + ".*")


def freeze(wl: Workload, patterns: list[str], dtype: str, *, where: str = "model.frozen") -> Workload:
    """`wl` with every parameter a pattern matches frozen and stored in `dtype`. A pattern that matches
    nothing is refused, naming it."""
    names = [p.name for p in wl.params]
    for i, pattern in enumerate(patterns):
        if not any(matches(n, pattern) for n in names):
            example = names[min(1, len(names) - 1)] if names else "none"
            raise ScenarioError(f"{where}[{i}]: {show(pattern)} matches no parameter of {show(wl.name)} "
                                f"(names such as {example!r}; a module prefix such as 'tok_embeddings' also works)")
    return freeze_where(wl, lambda p: any(matches(p.name, pat) for pat in patterns), dtype)


def freeze_where(wl: Workload, is_frozen, dtype: str, reads_input: frozenset[str] = frozenset()) -> Workload:
    """`wl` with the parameters `is_frozen(param)` names frozen and stored in `dtype` (non-floating storages
    such as a packed 4-bit base keep theirs). `reads_input`: parameter-name prefixes of Linears whose input
    a trainable adapter keeps (LoRA without dropout), so freezing their weight does not drop that input."""
    def frozen(p: Param) -> Param:
        if not is_frozen(p):
            return p
        return Param(p.name, p.shape, dtype if p.dtype in FROZEN_DTYPES else p.dtype, False)  # every field: no replace()

    modules = tuple(replace(m, params=tuple(frozen(p) for p in m.params)) for m in wl.modules)
    before = wl.meta.get(UNFROZEN)
    source = (wl.modules, dtype, reads_input) if before is None else (before[0], before[1], before[2] | reads_input)
    return without_frozen_gradients(replace(wl, modules=modules, meta={**wl.meta, UNFROZEN: source}), reads_input)


def without_frozen_gradients(wl: Workload, reads_input: frozenset[str] = frozenset()) -> Workload:
    """The backward of every module as autograd runs it with the parameters' current `trainable` flags.

    Walked in forward order: until the first trainable parameter no tensor requires grad (the inputs are
    token ids), so those modules record no graph at all: nothing saved, no backward. The module that meets
    the first trainable parameter gets an input without grad, so an unfused norm at its start keeps no
    fp32 copy of it and no rstd (they serve only the input's gradient), and a fused one whose parameters
    are frozen too records nothing: neither its input nor its statistics."""
    trainable = {p.name: p.trainable for p in wl.params}
    p_act = itemsize(wl.activation_dtype)
    unfused = wl.meta.get("norm_impl") in ("composite", "hf_llama")  # transformer.norm_saves
    tied = {n for m in wl.modules for n in m.tied_params}
    grad_flows = False
    modules = []
    for m in wl.modules:
        names = [p.name for p in m.params] + list(m.tied_params)
        any_trainable = any(trainable[n] for n in names)
        if not grad_flows and not any_trainable:
            modules.append(_inert(m))
            continue
        input_grad, grad_flows = grad_flows, True
        if all(trainable[n] for n in names) and input_grad:
            modules.append(m)
            continue
        weights = weight_index(names)
        needs_dw = {k.name: _weight_trainable(k.name, names, weights, trainable)
                    for k in m.kernels if k.kind in ("gemm", "norm_unfused")}
        kernels = tuple(replace(k, weight_grad=needs_dw[k.name]) if k.kind == "gemm" and k.weight_grad != needs_dw[k.name]
                        else k for k in m.kernels)
        dropped = sum(_norm_unkept(k, needs_dw[k.name], p_act, wl.meta["norm_impl"])
                      for k in kernels if k.kind == "norm_unfused" and unfused)
        saves_input = m.saves_input
        first = kernels[0] if kernels and kernels[0].shape else None
        if not input_grad and first is not None and first.kind == "norm_unfused" and unfused:
            tok, hidden = first.shape
            dropped += (tok * hidden * 4 if p_act != 4 else 0) + tok * 4  # the fp32 copy of the input, rstd
            saves_input = saves_input and p_act != 4  # an fp32 input is that copy (`transformer.norm_saves`)
        first_frozen = first is not None and _all_frozen(first.name, names, trainable)
        inert_norm = not input_grad and first_frozen and first.kind in ("norm", "norm_unfused")
        if inert_norm and first.kind == "norm":  # nothing of the fused norm needs a gradient: it saves nothing
            dropped += _fused_norm_stats(names, first.name) * first.shape[0] * 4
            saves_input = False
        if inert_norm and m.is_block:  # attention's Linears read a tensor without grad: no input gradient
            # for them or their adapters' lora_A, no backward for the norm, and the adapters' dropouts
            # (native_dropout) record no node, so keep no mask
            qkv = ("wq", "wk", "wv")
            gemms = {k.name: k for k in kernels if k.kind == "gemm"}
            kernel_names = {k.name for k in kernels}
            dropped += sum(gemms[r].shape[0] * gemms[r].shape[2] for r in qkv
                           if r in gemms and r + LORA_DROPOUT in kernel_names)
            readers = set(qkv) | {r + LORA_A for r in qkv}
            no_backward = {first.name} | {r + LORA_DROPOUT for r in qkv}
            kernels = tuple(replace(k, bwd_bytes=0.0, bwd_launches=0) if k.name in no_backward else
                            replace(k, input_grad=False) if k.kind == "gemm" and k.name in readers else k for k in kernels)
        tail, bwd_temp = m.bwd_tail_bytes, m.bwd_temp_bytes
        if m.is_block:
            unkept, unkept_bytes = _unkept_inputs(m, needs_dw, reads_input, p_act)
            dropped += unkept_bytes
            frozen_norms = {"ffn_norm"} if _all_frozen("ffn_norm", names, trainable) else set()
            bwd_temp = _block_bwd_temp(m, wl.meta.get(BLOCK_RECIPE), needs_dw, unkept, frozen_norms)
            # attention_norm's last moment: none without an input gradient (nothing past it wants one);
            # less what a frozen norm weight no longer keeps
            norm0 = first if first is not None and first.kind == "norm_unfused" and unfused else None
            unkept_norm = _norm_unkept(norm0, needs_dw[norm0.name], p_act, wl.meta["norm_impl"]) if norm0 else 0
            tail = max(0, tail - unkept_norm) if input_grad else 0
        elif m.kind == "norm" and first_frozen:
            # a frozen norm's backward: no weight gradient, the same peak for what it no longer keeps
            # (`transformer.norm_backward_moment`)
            impl = wl.meta.get("norm_impl", "fused") if first.kind == "norm_unfused" else "fused"
            bwd_temp += weight_only_saves(impl, *first.shape, p_act) - sum(q.numel for q in m.params) * p_act
        elif not any(trainable[q.name] for q in m.params if q.name in tied):
            tail = 0  # an embedding's moment is its tied weight's two gradients meeting: none when frozen
        m = replace(m, kernels=kernels, saved_bytes=max(0, m.saved_bytes - dropped), bwd_temp_bytes=bwd_temp,
                    bwd_tail_bytes=tail, saves_input=saves_input)
        adapter_reads = any(n.startswith(r) for r in reads_input for n in names)
        if m.kind == "head" and not any(needs_dw.values()) and not adapter_reads:
            m = replace(m, saves_input=False)
        if m.kernels:
            m = replace(m, bwd_flops=sum(k.bwd_flops for k in m.kernels))
        modules.append(m)
    model_flops = sum(m.fwd_flops + m.bwd_flops for m in modules)
    return replace(wl, modules=tuple(modules), model_flops=float(model_flops))


def _inert(m: Module) -> Module:
    """A module that records no autograd graph: it saves nothing and runs no backward kernel. Its forward
    holds what its code refers to, as a checkpointed block's does (`Module.nosave_fwd_peak_bytes`; where
    that is not known, at most what it would have saved and its transients)."""
    kernels = tuple(replace(k, weight_grad=False, input_grad=False, bwd_bytes=0.0, bwd_launches=0) for k in m.kernels)
    temp = m.nosave_fwd_peak_bytes - m.output_bytes if m.nosave_fwd_peak_bytes else m.fwd_temp_bytes + m.saved_bytes
    return replace(m, kernels=kernels, saved_bytes=0, fwd_temp_bytes=temp, saves_input=False, bwd_temp_bytes=0,
                   bwd_tail_bytes=0, bwd_flops=0.0, records_graph=False)


def _norm_unkept(k: Kernel, weight_grad: bool, p: int, impl: str) -> int:
    """An unfused RMSNorm whose weight is frozen keeps no normalized x: only `normalized * weight`'s weight
    gradient reads it (fp32 in the composite kernel, the activation dtype in Hugging Face's)."""
    return 0 if weight_grad else weight_only_saves(impl, *k.shape, p)


def _layer(kernel: str) -> str:
    """The layer a kernel runs, named as the builders name a kernel (`wq`) or as `fsdp-sim trace` does
    (`attention.wq: mm`)."""
    return kernel.split(":")[0].strip()


def _layer_params(kernel: str, names: list[str]) -> list[str]:
    """The parameters of the layer a kernel runs (`<...>.<layer>.<name>`)."""
    layer = _layer(kernel)
    return [n for n in names if n.startswith(f"{layer}.") or f".{layer}." in n]


def _all_frozen(kernel: str, names: list[str], trainable: dict[str, bool]) -> bool:
    own = _layer_params(kernel, names)
    return bool(own) and not any(trainable[n] for n in own)


def _fused_norm_stats(names: list[str], kernel: str) -> int:
    """The fp32 per-row statistics a fused norm saves (`transformer.NORM_STAT_TENSORS`): LayerNorm's mean and
    rstd (the builders give it a bias), RMSNorm's rstd."""
    return NORM_STAT_TENSORS["layernorm" if any(n.endswith(".bias") for n in _layer_params(kernel, names)) else "rmsnorm"]


def _weight_trainable(kernel: str, names: list[str], weights: dict[str, list[str]], trainable: dict[str, bool]) -> bool:
    """Whether the layer a kernel runs has a trainable weight (`<...>.<kernel>.weight`, or the module's only
    parameter for a one-Linear module such as the head); unknown weights count as trainable. `weights`:
    `weight_index(names)`."""
    owned = linear_weights(kernel, weights) or (names if len(names) == 1 else [])
    return any(trainable[n] for n in owned) if owned else True


def weight_index(names: list[str]) -> dict[str, list[str]]:
    """The weights among `names` (`<...>.<layer>.weight`) by the last name of their layer (`wq`), in `names`'
    order: made once per module, so that finding a kernel's weight (`linear_weights`) looks at the few that
    end alike instead of at every name of the module for every kernel."""
    index: dict[str, list[str]] = {}
    for n in names:
        if n.endswith(".weight"):
            index.setdefault(n[:-len(".weight")].rsplit(".", 1)[-1], []).append(n)
    return index


def linear_weights(kernel: str, weights: dict[str, list[str]]) -> list[str]:
    """The weight a kernel's layer owns: `<...>.<layer>.weight` (`_layer`; a layer may be dotted, as
    `fsdp-sim trace` names it: `attention.wq`), among `weight_index`'s."""
    layer = _layer(kernel)
    alike = weights.get(layer.rsplit(".", 1)[-1], [])
    if "." not in layer:
        return alike
    return [n for n in alike if n == f"{layer}.weight" or n.endswith(f".{layer}.weight")]


def _unkept_inputs(m: Module, needs_dw: dict[str, bool], reads_input: frozenset[str], p: int) -> tuple[frozenset[str], int]:
    """The Linears whose input only frozen Linears read (see the module docstring), and that input's bytes;
    none for a block whose kernels are not `transformer.block_kernels`' layout."""
    kinds = {k.kind for k in m.kernels}
    gemms = {k.name: k for k in m.kernels if k.kind == "gemm"}
    unkept, dropped = set(), 0
    for readers, needs_kind in _INPUT_GROUPS:
        present = [r for r in readers if r in gemms]
        if not present or (needs_kind is not None and needs_kind not in kinds):
            continue
        if any(needs_dw[r] or _adapter_reads(m, r, reads_input) for r in present):
            continue
        tok, _, fan_in = gemms[present[0]].shape
        unkept.update(present)
        dropped += tok * fan_in * p
    return frozenset(unkept), dropped


def unkept_inputs(m: Module) -> frozenset[str]:
    """The Linears of block `m` whose input no one keeps, as its kernels' `weight_grad` flags leave them (no
    adapter reading a base's input: peft's input cast gives lora_A a copy of its own, `lora.peft_input_casts`)."""
    needs_dw = {k.name: k.weight_grad for k in m.kernels if k.kind == "gemm"}
    return _unkept_inputs(m, needs_dw, frozenset(), 1)[0]


def built_from(m: Module, recipe: dict | None) -> bool:
    """Whether block `m` is one the builder made from `recipe` (Workload.meta[BLOCK_RECIPE]): its Linears
    (wq .. w2) all there, at the recipe's shapes, whatever kernels transforms added beside them."""
    if recipe is None:
        return False
    built = recipe_gemm_shapes(recipe)
    names = {k.name for k in m.kernels}
    return built.keys() <= names and all(k.shape == built.get(k.name, k.shape) for k in m.kernels if k.kind == "gemm")


def _block_bwd_temp(m: Module, recipe: dict | None, needs_dw: dict[str, bool], unkept: frozenset[str],
                    frozen_norms: set[str]) -> int:
    """A dense block's backward peak as autograd runs it with its frozen Linears and norms: no weight
    gradient held at the MLP's moments, and an input never saved not released there (`transformer.block_activations`
    with `frozen` and `unkept`). Only for a block built from the dimensions in `recipe` (its Linears'
    shapes are the builder's); another keeps its own figure."""
    if not built_from(m, recipe):
        return m.bwd_temp_bytes
    frozen = frozenset(name for name in recipe_gemm_shapes(recipe) if not needs_dw[name]) | frozen_norms
    return recipe_activations(recipe, frozen=frozen, unkept=unkept).bwd_temp


def _adapter_reads(m: Module, kernel: str, reads_input: frozenset[str]) -> bool:
    return any(p.name.startswith(r) and r.endswith(f".{kernel}") for p in m.params for r in reads_input)


def packed_weights(names) -> frozenset[str]:
    """The parameters stored as packed 4-bit codes: those with block scales beside them (`lora.py`)."""
    names = set(names)
    return frozenset(n[:-len(QUANT_STATE_SUFFIX)] + ".weight" for n in names if n.endswith(QUANT_STATE_SUFFIX))


def trainable_counts(wl: Workload) -> tuple[int, int]:
    """(trainable, frozen) parameter counts, exact ints. A packed 4-bit weight holds two weights per byte of
    its storage (uint8, or the bf16 of `quant_storage`), as peft's `print_trainable_parameters` counts a
    `Params4bit`; its block scales are not weights."""
    trainable = frozen = 0
    packed = packed_weights(p.name for p in wl.params)
    for p in wl.params:
        if p.trainable:
            trainable += p.numel
        elif p.name in packed:
            frozen += 2 * p.numel * itemsize(p.dtype)
        elif not p.name.endswith(QUANT_STATE_SUFFIX):
            frozen += p.numel
    return trainable, frozen
