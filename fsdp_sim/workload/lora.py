"""LoRA and QLoRA (`model.lora`) as a transform of any workload: preset, Hugging Face config or traced.

peft's structure (`peft/tuners/lora/layer.py`, `Linear.forward`): beside each target Linear sit
`lora_A` (r x in) and `lora_B` (out x r), and the forward is
`result = base_layer(x); result = result + lora_B(lora_A(dropout(x))) * scaling`. What that costs:
- parameters: the adapters, trainable; every other parameter frozen (`mark_only_lora_as_trainable`,
  bias="none"), stored in `base_dtype`;
- kernels: two GEMMs per target (A's input gradient and both weight gradients in backward), the scale and
  the out-of-place add; `lora_dropout > 0` adds a dropout kernel per target (each target has its own
  `lora_dropout` module);
- saved tensors: A's output (tok x r), which B keeps; with dropout, its output (which A keeps) and its bool
  mask, per target. Without dropout (`nn.Identity`) A keeps the very input the base Linear read, so a frozen
  base still keeps that tensor alive (`frozen.py`). B's output and its scaled copy are transients.
QLoRA (`quantize: nf4`, Dettmers et al. 2023): every Linear of the blocks stored as bitsandbytes'
`quantize_4bit` stores it (`bitsandbytes/functional.py`): packed 4-bit codes, (n + 1) // 2 uint8, and one
absmax per block of 64; fp32 absmax (0.5 bit per weight), or with double quantization
(`compress_statistics=True`, the paper's default) uint8 absmax quantized in blocks of 256 with one fp32 scale
each, plus the fp32 mean subtracted first (8/64 + 32/(64 x 256) = 0.127 bit per weight, the paper's figure).
Under FSDP2 the codes and scales are sharded and all-gathered as bytes (torchao's `NF4Tensor`, torchtune's
QLoRA, all-gathers its quantized data and scalers through `fsdp_pre_all_gather`).
`quant_storage` is `bnb_4bit_quant_storage` (`Linear4bit(quant_storage=...)`): the dtype of the tensor
the codes are packed in, `torch.empty(((n + 1) // (quant_storage.itemsize * 2), 1), dtype=quant_storage)`
(`bitsandbytes/backends/cuda/ops.py`, `quantize_4bit`): the same bytes, in elements of that dtype. The
default uint8 is an integer tensor, which FSDP1 refuses to flatten (`_validate_tensors_to_flatten`:
"Cannot flatten integer dtype tensors"); bf16 is what Answer.AI's fsdp_qlora and accelerate pass so that
FSDP1 can flatten and shard the base with the rest of its block. The scales are `QuantState` tensors, a
module attribute, not a parameter (`Linear4bit.quant_state`, restored by
`fix_4bit_weight_quant_state_from_module`: "the quant state got lost when the parameter got converted.
This happens for example for fsdp"): FSDP1 leaves them whole on every rank (`schedule/fsdp1_flat.py`). Every matmul dequantizes
the full weight to the compute dtype first, forward and backward (`bnb.matmul_4bit`'s `MatMul4Bit` saves
the quantized weight, not the dequantized one): a weight-sized temporary and a memory-bound kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_sim.datafile import get_key, reject_unknown_keys
from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.workload.frozen import (LORA_A, LORA_B, LORA_DROPOUT, LORA_SCALE_ADD, QUANT_STATE_SUFFIX, UNFROZEN,
                                      built_from, freeze_where, linear_weights, unkept_inputs,
                                      weight_index)
from fsdp_sim.workload.kernels import elementwise, gemm
from fsdp_sim.workload.model import Kernel, Module, Param, Workload, share_kernels
from fsdp_sim.workload.transformer import BLOCK_RECIPE, recipe_activations, unsaved_references

PEFT_INPUT_CAST = " peft input cast"  # `_cast_input_dtype`: x.to(lora_A.weight.dtype) (peft_input_casts)
PEFT_AUTOCAST_CAST = " lora_A autocast cast"  # autocast casting that copy back for lora_A's matmul
# transformers' Llama / Mistral / Qwen module names -> the workload's (torchtitan's)
PEFT_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w1", "up_proj": "w3",
              "down_proj": "w2"}
NF4_BLOCKSIZE = 64  # bitsandbytes quantize_4bit's default blocksize (QLoRA paper, section 3)
DOUBLE_QUANT_BLOCKSIZE = 256  # quantize_blockwise(absmax, blocksize=256) under compress_statistics
FP32 = 4
QUANT_STORAGES = ("uint8", "bf16", "fp16", "fp32")  # Linear4bit(quant_storage=torch.uint8) by default
LORA_CONFIG = "lora_config"  # Workload.meta: the LoraConfig applied (`autograd_view` re-applies its quantization)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """peft's `LoraConfig` fields that cost memory or time, and QLoRA's quantisation of the base."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    quantize: str | None = None  # None | "nf4"
    double_quant: bool = True
    base_dtype: str = "bf16"
    quant_storage: str = "uint8"


def nf4_bytes(numel: int, double_quant: bool) -> tuple[int, int]:
    """(packed codes, block scales) bytes of one weight of `numel` elements as quantize_4bit stores it."""
    blocks = -(-numel // NF4_BLOCKSIZE)
    if not double_quant:
        return (numel + 1) // 2, FP32 * blocks
    scales = blocks + FP32 * -(-blocks // DOUBLE_QUANT_BLOCKSIZE) + FP32  # uint8 absmax, fp32 state2.absmax, offset
    return (numel + 1) // 2, scales


def packed_shape(numel: int, quant_storage: str) -> tuple[int, int]:
    """The shape of the tensor quantize_4bit packs `numel` weights in: ((n + 1) // (itemsize * 2), 1)
    elements of `quant_storage` (`bitsandbytes/backends/cuda/ops.py`, `quantize_4bit`)."""
    return (numel + 1) // (itemsize(quant_storage) * 2), 1


def apply_lora(wl: Workload, cfg: LoraConfig, where: str = "model.lora") -> Workload:
    """`wl` with peft's adapters beside every target Linear of its blocks, the rest frozen (QLoRA: quantized)."""
    p = itemsize(wl.activation_dtype)
    wanted = {PEFT_NAMES.get(t, t) for t in cfg.targets}
    modules, hit, reads_input = [], set(), set()
    recipe = wl.meta.get(BLOCK_RECIPE)
    for m in wl.modules:
        modules.append(_with_adapters(m, wanted, cfg, p, hit, reads_input, recipe) if m.is_block else m)
    if not hit:
        example = sorted({name for m in wl.modules if m.is_block for name in _linears(m)})
        raise ScenarioError(f"{where}.targets: {show(list(cfg.targets))} names no Linear of {show(wl.name)}'s blocks "
                            f"(its Linears: {example or 'none'}; peft's names {sorted(PEFT_NAMES)} or 'all-linear')")
    missing = sorted(wanted - hit - {"all-linear"})
    if missing:
        raise ScenarioError(f"{where}.targets: {missing} name no Linear of {show(wl.name)}'s blocks")
    wl = freeze_where(replace(wl, modules=tuple(modules)), lambda q: ".lora_" not in q.name, cfg.base_dtype,
                      frozenset(reads_input))
    if cfg.quantize:  # once frozen: the blocks' bytes are then what autograd keeps of a frozen base
        wl = quantized(wl, cfg)
    return replace(wl, meta={**wl.meta, LORA_CONFIG: cfg})


def quantized(wl: Workload, cfg: LoraConfig) -> Workload:
    """`wl` with every block's base Linears stored as 4-bit codes and scales (`_quantized`)."""
    p = itemsize(wl.activation_dtype)
    return replace(wl, modules=tuple(_quantized(m, cfg, p) if m.is_block else m for m in wl.modules))


def autograd_view(wl: Workload, requires_grad: frozenset[str], reads_input: frozenset[str] | None = None) -> Workload:
    """`wl` as autograd runs it when the parameters `requires_grad` names need a gradient and no other does,
    whatever is trained: FSDP1 with `use_orig_params=True` gives every view of a FlatParameter that requires
    grad a gradient (`schedule/fsdp1_flat.py`). Re-frozen from the modules before any freezing
    (`frozen.freeze_where` keeps them), then quantized again as `model.lora` asked. A 4-bit base stays
    without a gradient: bitsandbytes' `MatMul4Bit.backward` returns none for it and saves only the codes.
    The parameters keep their flags and dtypes in `wl` (what the optimizer steps); here they only say what
    autograd computes. `reads_input`, where given, replaces the Linears whose input an adapter keeps."""
    source = wl.meta.get(UNFROZEN)
    if source is None:
        return wl
    modules, dtype, kept = source
    reads_input = kept if reads_input is None else reads_input
    view = freeze_where(replace(wl, modules=modules), lambda q: q.name not in requires_grad, dtype, reads_input)
    cfg = wl.meta.get(LORA_CONFIG)
    if cfg is not None and cfg.quantize:
        view = quantized(view, cfg)
    times = {m.name: (m.fwd_time_s, m.bwd_time_s) for m in wl.modules}  # a measured module keeps its times
    return share_kernels(replace(view, modules=tuple(replace(m, fwd_time_s=times[m.name][0], bwd_time_s=times[m.name][1])
                                                     if m.name in times else m for m in view.modules)))


def _linears(m: Module) -> dict[str, tuple[Kernel, Param]]:
    """The block's Linears by their layer's last name (`wq`): each gemm kernel with the 2-D weight it runs."""
    params = {q.name: q for q in m.params if len(q.shape) == 2 and ".lora_" not in q.name}
    index = weight_index(list(params))
    out = {}
    for k in m.kernels:
        weights = linear_weights(k.name, index) if k.kind == "gemm" else []
        if len(weights) == 1:
            out[weights[0][:-len(".weight")].rsplit(".", 1)[-1]] = (k, params[weights[0]])
    return out


def _with_adapters(m: Module, wanted: set[str], cfg: LoraConfig, p: int, hit: set, reads_input: set,
                   recipe: dict | None) -> Module:
    linears = _linears(m)
    targets = set(linears) if "all-linear" in wanted else wanted & set(linears)
    if not targets:
        return m
    hit.update(targets | ({"all-linear"} if "all-linear" in wanted else set()))
    params, kernels = list(m.params), []
    saved, temp = m.saved_bytes, m.fwd_temp_bytes
    r = cfg.rank
    by_kernel = {k.name: (name, weight) for name, (k, weight) in linears.items() if name in targets}
    for k in m.kernels:
        kernels.append(k)
        if k.name not in by_kernel:
            continue
        name, weight = by_kernel[k.name]
        tok, out, fan_in = k.shape
        prefix = weight.name[:-len(".weight")]
        params += [Param(f"{prefix}.lora_A.weight", (r, fan_in)), Param(f"{prefix}.lora_B.weight", (out, r))]
        if cfg.dropout > 0:  # read x, write the output and a one-byte mask (native_dropout); the grad likewise
            drop = 2 * tok * fan_in * p + tok * fan_in
            kernels.append(elementwise(name + LORA_DROPOUT, drop, drop, recompute=k.recompute))
            saved += tok * fan_in * p + tok * fan_in  # dropout output (kept by lora_A) and its mask
        else:
            reads_input.add(prefix)
        scale = 5 * tok * out * p  # `* scaling` reads B's output and writes a copy; the add reads two, writes one
        kernels += [gemm(name + LORA_A, tok, r, fan_in, recompute=k.recompute),
                    gemm(name + LORA_B, tok, out, r, recompute=k.recompute),
                    elementwise(name + LORA_SCALE_ADD, scale, 2 * tok * out * p, launches=2,
                                recompute=k.recompute)]
        saved += tok * r * p  # lora_A's output, kept by lora_B
        temp = max(temp, 2 * tok * out * p)  # B's output and its scaled copy, before the add
    # checkpointed, the block's forward holds each adapter's scaled output and sum beside the base output;
    # a block not built from dimensions keeps its figure, or 0 (unknown: its saved tensors bound it)
    nosave = recipe_activations(recipe, adapters=frozenset(targets)).nosave_peak \
        if m.nosave_fwd_peak_bytes and built_from(m, recipe) else m.nosave_fwd_peak_bytes
    return replace(m, params=tuple(params), kernels=tuple(kernels), saved_bytes=saved, fwd_temp_bytes=temp,
                   nosave_fwd_peak_bytes=nosave, fwd_flops=sum(k.fwd_flops for k in kernels),
                   bwd_flops=sum(k.bwd_flops for k in kernels))


def peft_input_casts(wl: Workload, adapter_bytes: int) -> Workload:
    """`wl` with peft's input cast for adapters stored wider than the activations: `lora.Linear.forward`
    runs `x = self._cast_input_dtype(x, lora_A.weight.dtype)` (peft `tuners/lora/layer.py`: `x.to(dtype)`
    when the dtypes differ) after the base layer. Under autocast with fp32 adapters on a bf16 base that is
    an fp32 copy of the Linear's input, alive until the layer's forward returns; the dropout then runs on
    it in fp32; lora_A's autocast casts it back and its matmul saves that copy, a new tensor where without
    the cast it shared the base layer's saved input (with dropout it saved the dropout's output, as large),
    and an input that only frozen base layers read is no longer kept at all (`autograd_view`). In
    backward the input gradient goes back through both casts and the dropout: ToCopyBackward gives an fp32
    gradient, the dropout's backward another, the second ToCopyBackward a compute-dtype one that is added
    to the base's input gradient. Per adapted Linear of n = tokens x in-features elements:
    - saved: + n in the compute dtype without dropout (lora_A's own copy); unchanged with it;
    - forward moment: the fp32 copy, and the dropout's fp32 output with dropout, beside the base output;
      then the copy beside the base output, the scaled adapter output and the sum, each beside the inputs
      the block's code holds that no frozen base saves (`transformer.unsaved_references`; in a checkpointed
      block's forward, which saves nothing, the moments `transformer._nosave_peak` adds for them);
    - backward moment: the two fp32 gradients with dropout (one and the compute-dtype one without); the
      base's input gradient is not made yet: autograd's ready queue runs the higher sequence number first
      (`torch/csrc/autograd/engine.h`, `CompareNodeTaskTime`) and the adapter's nodes were all created after
      `base_layer(x)`'s, so the whole adapter chain runs first; then the base's gradient, the adapter's and
      their out-of-place sum in the input's buffer (three compute-dtype tensors; eager referee: +1.78 % at
      the backward's peak with the base's gradient counted beside the fp32 ones, +0.01 % without);
    - kernels: the two casts each way (read one dtype, write the other), the dropout in fp32.
    Each moment is a moment of its own in the block: the block keeps the larger of it and its own."""
    if LORA_CONFIG not in wl.meta:
        return wl
    # no adapter reads its base layer's input any more: an input only frozen Linears read is not kept
    wl = autograd_view(wl, frozenset(p.name for p in wl.params if p.trainable), reads_input=frozenset())
    p = itemsize(wl.activation_dtype)
    q = adapter_bytes
    recipe = wl.meta.get(BLOCK_RECIPE)
    modules = []
    for m in wl.modules:
        adapters = {k.name[:-len(LORA_A)]: k for k in m.kernels if k.name.endswith(LORA_A)}
        if not adapters:
            modules.append(m)
            continue
        dropouts = {k.name[:-len(LORA_DROPOUT)] for k in m.kernels if k.name.endswith(LORA_DROPOUT)}
        saved, temp, bwd_temp, kernels = m.saved_bytes, m.fwd_temp_bytes, m.bwd_temp_bytes, []
        # what the code holds unsaved at each adapter's moment: a frozen base's input (none where unknown)
        held = unsaved_references(recipe, unkept_inputs(m)) if built_from(m, recipe) else {}
        for k in m.kernels:
            name = k.name[:-len(LORA_DROPOUT)] if k.name.endswith(LORA_DROPOUT) else k.name[:-len(LORA_A)]
            if name not in adapters or not k.name.endswith((LORA_DROPOUT, LORA_A)):
                kernels.append(k)
                continue
            tok, _, fan_in = adapters[name].shape
            n, out = tok * fan_in, next(b.shape[1] for b in m.kernels if b.name == name + LORA_B) * tok * p
            if k.name.endswith(LORA_DROPOUT):  # read x and write the output, fp32 now, and the mask
                kernels.append(replace(k, bytes=2 * n * q + n, bwd_bytes=2 * n * q + n))
                continue
            dropout = name in dropouts
            if not dropout:
                kernels.append(elementwise(name + PEFT_INPUT_CAST, n * (p + q), n * (p + q), recompute=k.recompute))
                saved += n * p
            kernels += [elementwise(name + PEFT_AUTOCAST_CAST, n * (p + q), n * (p + q), recompute=k.recompute), k]
            # the copies beside the base output; then the copy beside it, the scaled adapter output and the sum
            temp = max(temp, held.get(name, 0) + max(n * q * (2 if dropout else 1) + out, n * q + 3 * out))
            bwd_temp = max(bwd_temp, 2 * n * q if dropout else n * q + n * p, 3 * n * p)
        # with dropout the input cast comes before it: put it there
        for name in dropouts & set(adapters):
            tok, _, fan_in = adapters[name].shape
            at = next(i for i, k in enumerate(kernels) if k.name == name + LORA_DROPOUT)
            kernels.insert(at, elementwise(name + PEFT_INPUT_CAST, tok * fan_in * (p + q), tok * fan_in * (p + q),
                                           recompute=kernels[at].recompute))
        nosave = recipe_activations(recipe, adapters=frozenset(adapters), adapter_input=(q, bool(dropouts))).nosave_peak \
            if m.nosave_fwd_peak_bytes and built_from(m, recipe) else m.nosave_fwd_peak_bytes
        modules.append(replace(m, kernels=tuple(kernels), saved_bytes=saved, fwd_temp_bytes=temp, nosave_fwd_peak_bytes=nosave,
                               bwd_temp_bytes=bwd_temp, bwd_temp_parts=1 if bwd_temp != m.bwd_temp_bytes else m.bwd_temp_parts))
    return share_kernels(replace(wl, modules=tuple(modules)))


def _quantized(m: Module, cfg: LoraConfig, p: int) -> Module:
    """Every base Linear of the block (bitsandbytes replaces every nn.Linear but the head) as packed codes
    and scales, with a dequantize kernel before each matmul and the dequantized weight as a transient."""
    linears = _linears(m)
    bases = {weight.name for _, weight in linears.values()}
    params, largest = [], 0
    for q in m.params:
        if q.name not in bases:
            params.append(q)
            continue
        _, scales = nf4_bytes(q.numel, cfg.double_quant)
        params += [Param(q.name, packed_shape(q.numel, cfg.quant_storage), cfg.quant_storage, False),
                   Param(q.name[:-len(".weight")] + QUANT_STATE_SUFFIX, (scales,), "uint8", False)]
        largest = max(largest, q.numel * p)
    kernels = []
    by_kernel = {k.name: (name, weight) for name, (k, weight) in linears.items()}
    for k in m.kernels:
        if k.name in by_kernel:
            name, weight = by_kernel[k.name]
            packed, scales = nf4_bytes(weight.numel, cfg.double_quant)
            traffic = packed + scales + weight.numel * p  # read codes and scales, write the weight
            launches = 2 if cfg.double_quant else 1  # the absmax is dequantized first
            kernels.append(elementwise(f"{name} dequantize nf4", traffic, traffic, launches=launches,
                                       bwd_launches=launches, recompute=k.recompute))
        kernels.append(k)
    return replace(m, params=tuple(params), kernels=tuple(kernels), fwd_temp_bytes=max(m.fwd_temp_bytes, largest),
                   bwd_temp_bytes=max(m.bwd_temp_bytes, largest))


ADAPTATION_KEYS = ("frozen", "frozen_dtype", "lora")
_LORA_KEYS = {"rank", "alpha", "targets", "dropout", "quantize", "double_quant", "quant_storage"}


def adapt_workload(wl: Workload, keys: dict) -> Workload:
    """`model.frozen`, `model.frozen_dtype` and `model.lora` applied to a built workload."""
    from fsdp_sim.workload.frozen import FROZEN_DTYPES, freeze

    dtype = get_key("model", keys, "frozen_dtype", str, "bf16", choices=FROZEN_DTYPES)
    if "lora" in keys:
        raw = keys["lora"]
        if not isinstance(raw, dict):
            raise ScenarioError(f"model.lora: expected a mapping (rank, alpha, targets, dropout, quantize), "
                                f"got {show(raw)}")
        reject_unknown_keys("model.lora", raw, _LORA_KEYS)
        cfg = LoraConfig(rank=get_key("model.lora", raw, "rank", int, 8, positive=True, maximum=1 << 16),  # peft defaults
                         alpha=get_key("model.lora", raw, "alpha", float, 8.0),
                         targets=_names("model.lora.targets", raw.get("targets", ["q_proj", "v_proj"])),
                         dropout=get_key("model.lora", raw, "dropout", float, 0.0),
                         quantize=get_key("model.lora", raw, "quantize", str, None, choices=("nf4",)),
                         double_quant=get_key("model.lora", raw, "double_quant", bool, True), base_dtype=dtype,
                         quant_storage=get_key("model.lora", raw, "quant_storage", str, "uint8", choices=QUANT_STORAGES))
        if not 0 <= cfg.dropout < 1:
            raise ScenarioError(f"model.lora.dropout: expected a probability in [0, 1), got {cfg.dropout}")
        for key in ("double_quant", "quant_storage"):
            if key in raw and cfg.quantize is None:
                raise ScenarioError(f"model.lora.{key}: only with model.lora.quantize: nf4")
        wl = apply_lora(wl, cfg)
    if "frozen" in keys:
        wl = freeze(wl, _names("model.frozen", keys["frozen"]), dtype)
    elif "frozen_dtype" in keys and "lora" not in keys:
        raise ScenarioError("model.frozen_dtype: only with model.frozen or model.lora "
                            "(it is the frozen parameters' dtype)")
    return share_kernels(wl)


def _names(where: str, value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ScenarioError(f"{where}: expected a list of names (patterns), got {show(value)}")
    return tuple(value)
