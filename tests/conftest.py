"""Shared helpers: scenario dictionaries as a user writes them, and a hypothesis strategy over small models.

Every test builds its scenario through `parse_scenario` (the same path the CLI takes), on the
`h100-sxm` profile, so the tests exercise the validated, resolved configuration and not hand-made
internals.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from fsdp_sim.scenario import STRATEGIES, parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.wrap import POLICIES

PROFILE = "h100-sxm"


def scenario_dict(model: dict, *, nodes: int = 1, gpus_per_node: int = 8, fsdp: dict | None = None,
                  training: dict | None = None) -> dict:
    """A scenario mapping as it would appear in a YAML file."""
    return {"model": dict(model), "training": dict(training or {"micro_batch": 1, "seq_len": 16}),
            "hardware": {"profile": PROFILE, "nodes": nodes, "gpus_per_node": gpus_per_node},
            "fsdp": dict(fsdp or {})}


def run(data: dict):
    """Parse and simulate a scenario mapping; returns (Scenario, StepResult)."""
    scenario = parse_scenario(data)
    return scenario, simulate(scenario)


def padded_shard_numel(shape: tuple[int, ...], world: int) -> int:
    """torch.chunk along dim 0 into `world` pieces, every piece padded to the first (largest) one.

    Computed here from the shape alone, independently of `Param.padded_shard_numel`.
    """
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


@st.composite
def model_dicts(draw, *, max_layers: int = 6) -> dict:
    """A small decoder transformer: hidden = heads x head_dim, kv_heads dividing heads, any vocab."""
    heads = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    return {
        "hidden": heads * head_dim, "layers": draw(st.integers(1, max_layers)), "heads": heads,
        "kv_heads": draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0])),
        "vocab": draw(st.integers(50, 5000)),  # mostly not divisible by the world size: dim-0 padding
        "mlp": draw(st.sampled_from(["gelu", "swiglu"])), "tie_embeddings": draw(st.booleans()),
        "norm": draw(st.sampled_from(["rmsnorm", "layernorm"])), "bias": draw(st.booleans()),
        "attention": draw(st.sampled_from(["sdpa", "eager"])),
    }


def _block_numel(m: dict) -> int:
    h, kvd, f = m["hidden"], m["kv_heads"] * m["hidden"] // m["heads"], 4 * m["hidden"]
    return h * (2 * h + 2 * kvd) + (3 if m["mlp"] == "swiglu" else 2) * h * f


@st.composite
def scenario_dicts(draw) -> dict:
    """A random small training setup over every FSDP option the scenario format offers.

    `size_based` draws `min_params` from 1 up, so the embedding and head may get units of their own.
    """
    model = draw(model_dicts())
    nodes, gpn = draw(st.integers(1, 2)), draw(st.integers(1, 8))
    wrap = draw(st.sampled_from([p for p in POLICIES if p != "peft"]))  # peft: FSDP1's auto_wrap_policy only
    fsdp = {"wrap": wrap, "sharding_strategy": draw(st.sampled_from(sorted(STRATEGIES))),
            "backward_prefetch": draw(st.booleans()), "requires_gradient_sync": draw(st.booleans()),
            "reshard_last_block": draw(st.booleans()),
            "mixed_precision": {"param_dtype": draw(st.sampled_from(["fp32", "bf16"])),
                                "reduce_dtype": draw(st.sampled_from(["fp32", "bf16"]))}}
    if draw(st.booleans()):  # an explicit shard group size (FSDP2's 2-D mesh), any divisor of the world
        world = nodes * gpn
        fsdp["shard_size"] = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    if wrap == "every_k_blocks":
        fsdp["blocks_per_unit"] = draw(st.integers(1, 3))
    if wrap == "size_based":
        fsdp["min_params"] = 1 + draw(st.integers(0, 2 * model["layers"] * _block_numel(model)))
    training = {"micro_batch": draw(st.integers(1, 4)), "seq_len": draw(st.integers(8, 256)),
                "grad_accumulation": draw(st.integers(1, 3)),
                "optimizer": draw(st.sampled_from(["adamw", "sgd"])),
                "activation_checkpointing": draw(st.sampled_from(["none", "full"]))}
    return scenario_dict(model, nodes=nodes, gpus_per_node=gpn, fsdp=fsdp, training=training)


# ---- the order the test workers take the tests in ------------------------------------------------------------
# `-n auto` runs the suite on every core; its wall is the busiest worker's. The torch referee's cases (FSDP2 and
# FSDP1 under FSDPMemTracker, the eager referee, Inductor compiling a block: 4-20 s each, about half of the
# suite's CPU) go first and the many sub-second tests after, so the workers end together on short tests rather
# than one finishing a 20 s case while the other waits (measured in --durations, 2026-12-04).
HEAVY_MODULES = frozenset({
    "test_compiled_block", "test_eager_referee", "test_eager_generations", "test_referee", "test_referee_fsdp1",
    "test_referee_fsdp1_lora", "test_referee_harness", "test_selective_ac", "test_lora", "test_loss", "test_tp",
    "test_tp_plans", "test_frozen", "test_optimizers", "test_fsdp2_torch_semantics", "test_sweep_rows", "test_dask",
})


def pytest_collection_modifyitems(session, config, items):
    """The heavy modules' and the slow-marked tests first (a stable sort: each keeps its order)."""
    items.sort(key=lambda item: not (item.module.__name__.rsplit(".", 1)[-1] in HEAVY_MODULES
                                     or item.get_closest_marker("slow")))


def pytest_xdist_make_scheduler(config, log):
    """Work stealing in place of xdist's default `load` (chunks handed out once): a worker that runs out takes
    half of the other's queue, so the heavy tests first are shared whatever their order in each chunk."""
    from xdist.scheduler import WorkStealingScheduling

    if config.getoption("dist") == "load":
        return WorkStealingScheduling(config, log)
    return None
