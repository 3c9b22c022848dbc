"""The referee for FSDP1 with frozen weights: fsdp-sim against PyTorch's MemTracker on FullyShardedDataParallel.

The ReferenceTransformer is prepared as peft leaves it (`lora_referee.prepare`: adapters beside the target
Linears, the rest frozen) or with `model.frozen`, then wrapped by FullyShardedDataParallel on rank r of a
fake process group (`memtracker_fsdp1.run_fsdp1_mem_tracker`) with `use_orig_params=True` and the block
policy, or with peft's `fsdp_auto_wrap_policy` (`wrap="peft"`); fsdp-sim simulates the same job
(`fsdp.version: 1`). Gate: the peak within 2 % (the issue asks 3 %). With use_orig_params the trained
parameters a rank's shard holds differ from rank to rank and fsdp-sim sizes the optimizer states for the
rank that holds the most, so that case is compared with the largest peak over the ranks.

The refusals are refereed too: torch's own `_validate_tensors_to_flatten` raises where fsdp-sim refuses.
Skipped without torch.
"""

from __future__ import annotations

from functools import partial

import pytest

pytest.importorskip("torch")

from fsdp_sim.errors import ScenarioError  # noqa: E402
from fsdp_sim.torch_tools.lora_referee import prepare, scenario_keys  # noqa: E402
from fsdp_sim.torch_tools.memtracker_fsdp1 import run_fsdp1_mem_tracker, simulate_fsdp1_reference  # noqa: E402
from fsdp_sim.torch_tools.reference_model import ReferenceConfig  # noqa: E402
from fsdp_sim.torch_tools.referee import BASE  # noqa: E402

# torch's own warning for a use_orig_params unit that mixes requires_grad ("the gradient memory usage will be
# higher than expected"): what these cases model
pytestmark = pytest.mark.filterwarnings("ignore:.*has both parameters with requires_grad=True and False:UserWarning")

SMALL = {"batch": 1, "seq": 32}
TWO = {"layers": 2, "vocab": 512}  # two blocks: a peft-wrapped block is a dozen FSDP instances to track
QKVO = {"targets": ("q_proj", "k_proj", "v_proj", "o_proj"), "rank": 8}
# fsdp_qlora's targets ("all": k, q, v, up, down, gate; not o_proj), its rank-to-alpha and dropout
FSDP_QLORA = {"targets": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"), "rank": 16,
              "alpha": 16.0, "dropout": 0.1}
PURE_BF16 = {"param_dtype": None, "reduce_dtype": None, "storage_dtype": "bf16"}  # fsdp_qlora's --precision bf16
# (id, model overrides, run settings, prepare's arguments, every rank)
CASES = [
    # use_orig_params: the frozen views' gradients, the whole flat gradient, states for the adapters only
    ("orig-params-lora-qkvo-fp32-base", {}, {"use_orig_params": True}, QKVO | {"frozen_dtype": "fp32"}, False),
    ("orig-params-lora-all-linear-ac-pure-bf16", TWO,
     PURE_BF16 | {"use_orig_params": True, "activation_checkpointing": "full"},
     {"targets": ("all-linear",), "rank": 8, "frozen_dtype": "bf16"}, False),
    # a frozen embedding in the root beside a trained head: its view requires grad, the whole chain records
    ("orig-params-frozen-embedding-and-block", {"vocab": 512}, SMALL | {"use_orig_params": True},
     {"frozen": ("tok_embeddings", "layers.0"), "frozen_dtype": "fp32"}, True),
    # peft's wrap: every adapter a unit of its own; the blocks and the root frozen FlatParameters
    ("peft-wrap-lora-all-linear", {"layers": 2}, {"wrap": "peft"}, {"targets": ("all-linear",), "rank": 16}, False),
    ("peft-wrap-lora-qv-ac-full", {"vocab": 512}, {"wrap": "peft", "activation_checkpointing": "full"},
     {"targets": ("q_proj", "v_proj"), "rank": 8}, False),
    ("peft-wrap-fsdp-qlora-targets-pure-bf16", TWO, SMALL | PURE_BF16 | {"wrap": "peft"},
     FSDP_QLORA | {"frozen_dtype": "bf16"}, False),
    # a frozen prefix is never gathered in backward (-2.4 % before: gathered by BACKWARD_PRE, held to the end)
    ("frozen-prefix-per-block", {"vocab": 512}, SMALL, {"frozen": ("tok_embeddings", "layers.0", "norm", "output"),
                                                         "frozen_dtype": "fp32"}, False),
]


def _settings(run: dict) -> dict:
    return {"world_size": 4, "batch": 2, "seq": 128} | run


def _simulate(cfg, settings: dict, prep: dict) -> dict:
    settings = dict(settings)
    wrap = settings.pop("wrap", "per_block")
    return simulate_fsdp1_reference(cfg, model_keys=scenario_keys(**prep), **settings,
                                    wrap="transformer_auto_wrap_policy" if wrap == "per_block" else wrap)


@pytest.mark.parametrize("case_id, model, run, prep, every_rank", CASES, ids=[c[0] for c in CASES])
def test_simulated_peak_agrees_with_mem_tracker_on_fsdp1_with_frozen_weights(case_id, model, run, prep, every_rank):
    cfg = ReferenceConfig(**(BASE | model))
    settings = _settings(run)
    ranks = range(settings["world_size"]) if every_rank else (0,)
    trackers = [run_fsdp1_mem_tracker(cfg, prepare_model=partial(prepare, **prep), rank=r, **settings) for r in ranks]
    tracker = max(trackers, key=lambda t: t["peak_bytes"])
    sim = _simulate(cfg, settings, prep)
    error = (sim["peak_bytes"] - tracker["peak_bytes"]) / tracker["peak_bytes"]
    assert abs(error) <= 0.02, (f"{case_id}: simulated peak {sim['peak_bytes']} vs MemTracker {tracker['peak_bytes']} "
                                f"({100 * error:+.3f} %), sim at {sim['phase']}/{sim['op']}, tracker at {tracker['peak_where']}")


REFUSALS = [
    # with an auto_wrap_policy _wrap_utils._validate_frozen_params says it before _validate_tensors_to_flatten
    ("mixed-requires-grad", {}, {"targets": ("q_proj", "v_proj"), "rank": 8, "frozen_dtype": "fp32"},
     "FSDP does not support wrapping such modules when use_orig_params=False", "fsdp.use_orig_params"),
    # "Must flatten tensors with uniform dtype": a bf16 base beside fp32 adapters, whatever use_orig_params
    ("mixed-dtypes", {"use_orig_params": True}, {"targets": ("q_proj", "v_proj"), "rank": 8, "frozen_dtype": "bf16"},
     "uniform dtype", "model.frozen_dtype"),
]


@pytest.mark.parametrize("case_id, run, prep, torch_says, key", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_fsdp_sim_refuses_what_fullyshardeddataparallel_refuses(case_id, run, prep, torch_says, key):
    cfg = ReferenceConfig(**(BASE | {"vocab": 512}))
    settings = _settings(SMALL | run)
    with pytest.raises(ValueError, match=torch_says):
        run_fsdp1_mem_tracker(cfg, prepare_model=partial(prepare, **prep), **settings)
    with pytest.raises(ScenarioError, match=f"^{key}"):
        _simulate(cfg, settings, prep)
