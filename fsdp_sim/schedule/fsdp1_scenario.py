"""The `fsdp:` keys of `version: 1` (FullyShardedDataParallel), in FSDP1's own words, and the refusal of the
keys only the other version has.

`fsdp1_options(fsdp, version)` returns the `fsdp` mapping with FSDP1's spellings translated to the shared
keys (`wrap: transformer_auto_wrap_policy` is `per_block`, `size_based_auto_wrap_policy` is `size_based`
with `min_num_params`) and the FSDPSettings fields FSDP1 sets (`backward_prefetch: BACKWARD_PRE |
BACKWARD_POST | none`, `forward_prefetch: true | false`, `limit_all_gathers`, `use_orig_params`,
`no_sync`, `cpu_offload: true` = `CPUOffload(offload_params=True)`, the sharding strategy). Defaults are FullyShardedDataParallel's constructor's,
but one: `mixed_precision`. FullyShardedDataParallel's default is `mixed_precision=None` (and `MixedPrecision()`'s
`param_dtype=None`): every FlatParameter is gathered, computed and reduced in its own dtype
(`_init_param_dtype`: `_fwd_bwd_param_dtype = mp_param_dtype or self._orig_param_dtype`, `_reduce_dtype`
likewise). fsdp-sim's `fsdp.mixed_precision.param_dtype` defaults to bf16 under both versions (the scenario
format's one default; FSDP2's `MixedPrecisionPolicy()` has no param_dtype either); torch's default is
`mixed_precision: {param_dtype: null}`, which fsdp-sim runs as written.

`wrap: peft` (peft's `fsdp_auto_wrap_policy`, `wrap.py`) is an `auto_wrap_policy`: version 1 only.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_sim.datafile import get_key
from fsdp_sim.errors import ScenarioError
from fsdp_sim.schedule.settings import FSDPSettings

FSDP1_ONLY = ("limit_all_gathers", "use_orig_params", "no_sync", "min_num_params", "cpu_offload")
# fully_shard's knobs FullyShardedDataParallel has no argument for (its strategy fixes the resharding)
# (offload_policy: offload.py's `offload_keys` names FSDP1's spelling of it)
FSDP2_ONLY = ("reshard_after_forward", "root_reshard_after_forward", "reshard_last_block", "requires_gradient_sync",
              "requires_all_reduce", "reshard_after_backward")
BACKWARD_PREFETCH = {"BACKWARD_PRE": "BACKWARD_PRE", "BACKWARD_POST": "BACKWARD_POST", "none": None}
# FSDP1's auto_wrap_policy functions onto the policies of wrap.py that wrap the same modules
WRAP_POLICIES = {"transformer_auto_wrap_policy": "per_block", "size_based_auto_wrap_policy": "size_based"}
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def fsdp1_options(fsdp: dict, version: int, gpu) -> tuple[dict, dict]:
    """(the `fsdp` mapping for the shared parsing, FSDPSettings fields to replace); the keys of the other
    version are refused with one line naming the key."""
    if version == 2:
        for key in FSDP1_ONLY:
            if key in fsdp:
                raise ScenarioError(f"fsdp.{key}: FullyShardedDataParallel's argument (fsdp.version: 1); "
                                    "fully_shard (version 2) has none")
        if fsdp.get("wrap") == "peft":
            raise ScenarioError("fsdp.wrap: peft is peft's fsdp_auto_wrap_policy, an auto_wrap_policy of "
                                "FullyShardedDataParallel (fsdp.version: 1); fully_shard (version 2) shards a group "
                                "that mixes frozen and trained parameters as it is: use per_block")
        for key in ("backward_prefetch", "wrap"):
            if isinstance(fsdp.get(key), str) and fsdp[key] in (*BACKWARD_PREFETCH, *WRAP_POLICIES):
                raise ScenarioError(f"fsdp.{key}: {fsdp[key]} is FSDP1's word (fsdp.version: 1); "
                                    "fully_shard takes " + ("true, false or a depth" if key == "backward_prefetch"
                                                            else "per_block, size_based, ..."))
        return fsdp, {}
    for key in FSDP2_ONLY:
        if key in fsdp:
            raise ScenarioError(f"fsdp.{key}: fully_shard's setting (fsdp.version: 2); under version 1 the "
                                "sharding_strategy decides when parameters are resharded")
    mp = fsdp.get("mixed_precision")
    if isinstance(mp, dict) and "output_dtype" in mp:
        raise ScenarioError("fsdp.mixed_precision.output_dtype: MixedPrecisionPolicy's (version 2); FSDP1's "
                            "MixedPrecision has no output dtype")
    strategy = fsdp.get("sharding_strategy", "FULL_SHARD")
    if "shard_size" in fsdp and strategy not in HYBRID:
        raise ScenarioError(f"fsdp.shard_size: under version 1 only a hybrid strategy takes a shard group "
                            f"(a 2-D device_mesh), not {strategy}")
    prefetch = fsdp.get("backward_prefetch", "BACKWARD_PRE")
    if prefetch is None:
        prefetch = "none"
    if not isinstance(prefetch, str) or prefetch not in BACKWARD_PREFETCH:
        raise ScenarioError(f"fsdp.backward_prefetch: under version 1 one of {list(BACKWARD_PREFETCH)}, "
                            f"got {prefetch!r}")
    wrap = fsdp.get("wrap", "per_block")
    if wrap == "torchtitan":
        raise ScenarioError("fsdp.wrap: torchtitan's wrapping calls fully_shard (version 2); under version 1 use "
                            f"one of {[*WRAP_POLICIES, 'per_block', 'every_k_blocks', 'size_based', 'whole_model', 'peft']}")
    shared = {k: v for k, v in fsdp.items() if k not in (*FSDP1_ONLY, "backward_prefetch", "forward_prefetch")}
    if isinstance(wrap, str) and wrap in WRAP_POLICIES:
        shared["wrap"] = WRAP_POLICIES[wrap]
    if "min_num_params" in fsdp:
        if "min_params" in fsdp:
            raise ScenarioError("fsdp.min_num_params: give min_num_params or min_params, not both")
        shared["min_params"] = fsdp["min_num_params"]
    no_sync = get_key("fsdp", fsdp, "no_sync", bool, False)
    cpu_offload = get_key("fsdp", fsdp, "cpu_offload", bool, False)  # CPUOffload(offload_params=True)
    if cpu_offload and gpu.host is None:
        raise ScenarioError(f"fsdp.cpu_offload: {gpu.name} has no host: section (host link and memory) in its profile")
    if cpu_offload and strategy == "NO_SHARD":
        raise ScenarioError("fsdp.cpu_offload: with NO_SHARD (blocking gradient copies, no all-gather) is not modelled yet")
    fields = {
        "version": 1,
        "sharding_strategy": strategy,
        "fsdp1_backward_prefetch": BACKWARD_PREFETCH[prefetch],
        "forward_prefetch": int(get_key("fsdp", fsdp, "forward_prefetch", bool, False)),
        "backward_prefetch": 1,
        "limit_all_gathers": get_key("fsdp", fsdp, "limit_all_gathers", bool, True),
        "use_orig_params": get_key("fsdp", fsdp, "use_orig_params", bool, False),
        # micro-batches but the last inside `no_sync()`: FSDP1 keeps the unsharded flat gradients
        "requires_gradient_sync": not no_sync,
        "offload_params": cpu_offload,
    }
    return shared, fields


def fsdp1_settings(settings: FSDPSettings, fields: dict) -> FSDPSettings:
    """The settings with FSDP1's fields; what this runtime does not model beside FSDP1 is refused."""
    if settings.tp > 1:
        raise ScenarioError(f"parallelism.tp: {settings.tp} with fsdp.version: 1 (FSDP1 over a 2-D mesh with "
                            "DTensor parameters) is not modelled yet; tensor parallel runs under version 2")
    if settings.float8_all_gather:
        raise ScenarioError("compute.float8.fsdp_float8_all_gather: torchao's float8 all-gather is fully_shard's "
                            "(fsdp.version: 2)")
    return replace(settings, **fields)
