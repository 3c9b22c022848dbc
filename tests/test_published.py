"""fsdp-sim against published end-to-end training runs: llm-foundry's MPT benchmark table and torchtitan's
FSDP2 performance tables.

Each file in scenarios/published/ is one published row written in the tool's keys: `mpt-*` rows of the
table in mosaicml/llm-foundry's scripts/train/benchmarking/README.md, `torchtitan-*` rows of
pytorch/torchtitan's docs/performance.md (Llama 3 8B and 70B on 8 to 256 GPUs, FSDP and FSDP x TP, with
torch.compile and Float8). Its `# published:` comment
line holds the row's own figures (NumParams, micro-batch, tokens/s per GPU, and for torchtitan's H100
tables the memory it logged, `max_memory_reserved`). What a row establishes, and so what is held:

- the model is the one that ran: the workload's parameter count equals the row's NumParams exactly (the
  benchmark's MPT has biases, learned position embeddings of max_seq_len rows and tied embeddings, which
  the count grows with seq_len by d_model per extra row confirms);
- the step fitted the GPU it ran on: the live tensors plus the CUDA context and the NCCL buffers must be
  within the GPU's capacity, and the tool's verdict `fits`, its allocator model replayed under that
  capacity, must be true. That says nothing about fsdp-sim's advisory 10 % safety margin
  (report.safety_margin, `within_budget`): four MPT rows (the 30B at 8192 tokens on A100 and H100, the 13B
  at 16384 on H100, the 1B at micro-batch 20 on H100) and torchtitan's 8-GPU row ran inside it;
- where the run logged its reserved memory, the simulated live tensors at the peak fit in it (allocated
  can never pass reserved). The allocator model's own reserved figure is above the logged one on both
  rows (85.3 GiB against 82.4 on 8 GPUs, with the expandable segments torchtitan's launcher sets; 77.3
  against 67.0 on 128, PyTorch's default allocator as that run's launcher is not published; torch.compile's
  saving, 5 GiB in the logs, is modelled only without checkpointing, and these rows checkpoint): it sees a
  module's saved activations and temporaries as one block each where PyTorch allocates ~15 tensors, so
  it overstates fragmentation; not gated, a known limit;
- throughput, as a band that is not fitted to anything: the tool prices a steady-state step with no data
  loader, logging or framework overhead, so it may not predict a run much slower than the published one;
  with kernels at the rates GPUs sustain through a long step (profiles' `sustained:`) and each torch
  release's own stack (hardware/software.py: torch 2.6's composite RMSNorm), a run whose GPUs held a
  higher clock than the profile's settled one can come out a little faster than predicted, so the floor
  is 0.9 (10 % slower than the run), and the ceiling 2x faster. The gap today is 1.02x to 1.57x on MPT,
  largest at 16k to 64k tokens, where the published runs' attention ran slower than the FlashAttention-2
  rate the tool prices (they installed flash-attn 1.0.9; priced as FlashAttention-1 those rows come out
  below the run, so neither kernel's table is theirs: docs/trust.md), and 0.98x to 1.16x on torchtitan's
  rows; see scenarios/published/.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

PUBLISHED = sorted((Path(__file__).resolve().parent.parent / "scenarios" / "published").glob("*.yaml"))
# the tool prices no overhead a real run has (lower bound) and is not wildly optimistic (upper bound)
MIN_RATIO, MAX_RATIO = 0.9, 2.0


def _row(path: Path) -> dict[str, str]:
    line = re.search(r"^# published: (.*)$", path.read_text(), re.M)
    assert line, f"{path.name}: no '# published:' line with the row's figures"
    return dict(field.split("=", 1) for field in line.group(1).split())


@cache
def _result(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    return simulate(parse_scenario(data, name=path.stem, base=path.parent)).to_dict()


def test_the_table_is_represented():
    """At least 20 rows, on both 80 GB GPU types, from 125M to 70B, from 512 to 65536 tokens."""
    rows = [_row(p) for p in PUBLISHED]
    assert len(rows) >= 20
    assert {"a100_80gb", "h100_80gb"} <= {r["gpu"] for r in rows}
    assert {"125m", "70b"} <= {r["size"] for r in rows}
    assert min(int(r["seq_len"]) for r in rows) <= 512 and max(int(r["seq_len"]) for r in rows) >= 65536


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: p.stem)
def test_parameter_count_is_the_published_one(path):
    """The whole model's count: a tensor-parallel run's result counts one rank's shard, so its model is
    counted without the TP plan."""
    data = yaml.safe_load(path.read_text())
    if data.pop("parallelism", None):
        data.get("compute", {}).pop("float8", None)  # converts the same Linears; counts nothing
        params = parse_scenario(data, name=path.stem, base=path.parent).workload.numel
    else:
        params = _result(path)["model"]["params"]
    assert params == int(_row(path)["num_params"])


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: p.stem)
def test_a_run_that_ran_fits_its_gpu(path):
    result = _result(path)
    memory = result["memory"]
    overheads = memory["overheads_bytes"]
    live = result["peak"]["allocated_bytes"] + overheads["cuda_context"] + overheads["nccl"]
    assert live <= memory["capacity_bytes"], f"{path.stem}: live tensors {live} over the capacity"
    assert memory["fits"], (f"{path.stem}: called out of memory: required {memory['required_bytes']} of "
                            f"{memory['capacity_bytes']} (allocated {result['peak']['allocated_bytes']}, "
                            f"reserved {result['peak']['reserved_bytes']})")


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: p.stem)
def test_throughput_is_within_the_stated_band_of_the_published(path):
    row = _row(path)
    result = _result(path)
    assert result["fsdp"]["grad_accumulation"] == int(row["grad_accumulation"])
    ratio = result["throughput"]["tokens_per_s_per_gpu"] / int(row["tokens_per_s_per_gpu"])
    assert MIN_RATIO <= ratio <= MAX_RATIO, f"{path.stem}: predicted / published tokens/s per GPU = {ratio:.2f}"


@pytest.mark.parametrize("path", [p for p in PUBLISHED if "max_reserved_gib" in _row(p)], ids=lambda p: p.stem)
def test_the_live_tensors_fit_in_what_the_run_reserved(path):
    """torchtitan logs `max_memory_reserved` (GiB): the simulated peak allocated cannot be above it."""
    logged = float(_row(path)["max_reserved_gib"]) * 2**30
    allocated = _result(path)["peak"]["allocated_bytes"]
    assert allocated <= logged, f"{path.stem}: simulated peak allocated {allocated / 2**30:.1f} GiB over the logged reserved"
