"""Fuzz the command line as an adversarial user would: `python benchmarks/fuzz.py N [--seed S] [--jobs J]`.

Each case mutates a shipped scenario (or a tiny one) and the files it points at (Hugging Face configs,
workload files, profiler traces, hardware profiles), or the raw YAML text, or a sweep's `--set` values,
or the command's own arguments, then runs `fsdp-sim` on it in a forked child (no shared state between
cases, a time limit and a memory limit each) and classifies what came back:

- ok: exit 0 (or 1: a step that does not fit under --require-fit, a sweep whose every point failed) with
  valid figures: strict JSON (no NaN / Infinity), every byte figure an exact int, every time finite and
  non-negative, MFU and overlap in [0, 1], headroom = budget - required, one-line row errors;
- clean error: exit 2 and one line on stderr, `fsdp-sim: error: ...`, of at most 300 characters;
  either may come with warnings, each one line `fsdp-sim: warning: ...` of at most 300 characters;
- traceback, hang (past the time limit), invalid figure, multi-line error, long error (one line over
  300 characters), code ran (a YAML tag executed something), crash (killed by a signal).

Prints the counts by outcome and, for each bad outcome, a few cases (what was mutated, the command and
the end of stderr). `tests/test_fuzz.py` draws a bounded number of the same cases with hypothesis.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = sorted(p for p in (REPO / "scenarios").glob("*.yaml") if not p.name.endswith(".grid.yaml"))  # grids are sweep axes
HF_CONFIGS = sorted((REPO / "scenarios" / "hf").glob("*.json"))
PROFILES = sorted((REPO / "hardware_profiles").glob("*.yaml"))
TRACE_FIXTURE = REPO / "tests" / "fixtures" / "profile_reference.json"
MAX_ERROR = 300
GOOD = ("ok", "clean error")

TINY = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 32},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}}
# the model the fixture trace was recorded from (tests/fixtures/make_profile_trace.py)
TRACED = {"model": {"hidden": 64, "layers": 2, "heads": 4, "ffn_hidden": 172, "vocab": 256, "norm_impl": "composite"},
          "training": {"micro_batch": 2, "seq_len": 32}, "hardware": {"profile": "h100-sxm", "gpus_per_node": 2},
          "compute": {"trace": "trace.json"}}

NUMERIC_KEYS = ["training.micro_batch", "training.seq_len", "training.grad_accumulation", "hardware.nodes",
                "hardware.gpus_per_node", "fsdp.shard_size", "fsdp.blocks_per_unit", "fsdp.min_params",
                "fsdp.version", "report.safety_margin", "model.hidden", "model.layers", "model.heads", "model.vocab",
                "model.kv_heads", "model.ffn_hidden", "model.head_dim", "model.max_seq",
                "hardware.network.nics_per_node", "hardware.network.nic_gbps", "hardware.network.nic_efficiency",
                "hardware.network.oversubscription", "hardware.network.hop_latency_s",
                "hardware.network.host_overhead_s", "hardware.network.spines", "hardware.network.nodes_per_leaf",
                "variation.gpu_speed_spread", "variation.seed"]
CHOICE_KEYS = ["training.optimizer", "training.optimizer_impl", "training.activation_checkpointing",
               "training.momentum", "fsdp.wrap", "fsdp.sharding_strategy", "fsdp.reshard_after_forward",
               "fsdp.backward_prefetch", "fsdp.reshard_last_block", "fsdp.requires_gradient_sync",
               "fsdp.mixed_precision.param_dtype", "fsdp.mixed_precision.reduce_dtype", "compute.allow_tf32",
               "compute.torch_compile", "compute.sdpa_backend", "compute.torch_version", "model.mlp", "model.norm",
               "model.attention", "model.norm_impl", "model.bias", "model.tie_embeddings", "model.learned_pos",
               "model.dropout", "model.preset", "name", "hardware.profile", "hardware.network.rail_optimized",
               "hardware.network.topology"]


class Raw:
    """A YAML or JSON fragment put verbatim where a value goes (deep nesting, tags, alias bombs)."""

    def __init__(self, yaml_text: str, json_text: str | None = None) -> None:
        self.yaml, self.json = yaml_text, json_text if json_text is not None else yaml_text

    def __repr__(self) -> str:
        return f"Raw({self.yaml[:40]!r})"


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


def _bomb(levels: int = 9) -> str:
    parts = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


YAML_RAW = [".inf", "-.inf", ".nan", ".NaN", "1.0e+300", "1e300", "1.0e+308", "-1.0e+308", "0x7fffffffffffffff",
            "0o777", "1_000", "12:30:00", "2024-01-01", "2024-01-01T00:00:00Z", "!!binary aGVsbG8=", "!!set {a, b}",
            "!!omap [a: 1, b: 2]", "!!python/name:os.system", "!!python/object/apply:os.system [\"touch PWNED\"]",
            "!!python/object/new:os.system [\"touch PWNED\"]", "!!str 5", "!!int '5'", "!!float 2", "!custom 5",
            "*undefined", "&x [*x]", "{[1, 2]: 3}", "{a: 1, a: 2}", "~", "yes", "on", "\"\\ud800\"", "\"\\x00\"",
            "\"a\\u2028b\"", "\"a\\nb\"", "\"a\\rb\"", "'\t'", "!!timestamp 2001-12-14", "-0", "+1", "0b101",
            "[1, [2, [3]]]", "{1: x, foo: y}", "{null: 1}", "{.nan: 1}", "!!null ''", "!!bool yes", "2.0", "64.0",
            "9223372036854775808", "18446744073709551616", "1" + "0" * 400, "1e39", "1.0e+39", "-1"]
JSON_RAW = ["NaN", "Infinity", "-Infinity", "1e999", "-0", "1" + "0" * 40, "1" + "0" * 400, "1.5e308", "2.0",
            "64.0", "1e-320", "true", "null", "\"\\ud800\"", "\"a\\nb\"", "[]", "{}", "9223372036854775808",
            "1e39", "0.5", "-1"]


def nasty(rng: random.Random, *, json_ok: bool = False) -> Any:
    """An adversarial value: huge, non-finite, of the wrong type, nested, tagged, very long."""
    r = rng.random()
    if r < 0.22:
        return rng.choice([0, -1, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30,
                           10**39, 2147483648, -(2**63)])
    if r < 0.40:
        return rng.choice([0.0, -0.0, 0.5, 1.5, 2.0, 8.0, 64.0, 1e300, 1e308, -1e308, 1e39, math.inf, -math.inf,
                           math.nan, 1e-300, 5e-324, 1e-9, 0.999999])
    if r < 0.55:
        return rng.choice(["", " ", "x", "llama3-8b", "a\nb", "a\rb", "a\u2028b", "é", "\x00", "\t",
                           "../../etc/passwd", "/", ".", "~", "1e3", "0x10", "none", "FULL_SHARD\n", "h100-sxm ",
                           "x" * rng.choice([300, 5000, 100_000]), "\U0001F600", "a" * 255 + ".yaml"])
    if r < 0.58 and rng.random() < 0.2:
        return "y" * 10_000_000
    if r < 0.68:
        return rng.choice([None, True, False, [], [1], [1, 2], {}, {"a": 1}, {1: "x", "foo": "y"},
                           [[1, [2, [3]]]], {"hidden": 64}, ["per_block"]])
    if r < 0.74 and not json_ok:
        return rng.choice([datetime.date(2024, 1, 1), datetime.datetime(2024, 1, 1, 12, 0), b"\x00\xff",
                           {"a", "b"}])
    if r < 0.80:
        depth = rng.choice([20, 90, 200, 999, 1100, 5000, 100_000])
        return Raw(_nest(depth))
    if r < 0.84 and not json_ok:
        return Raw(_bomb(rng.choice([4, 9])))
    return Raw(rng.choice(YAML_RAW), rng.choice(JSON_RAW))


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Placeholders:
    """Dump data with `Raw` values as placeholders, then put the fragments in."""

    def __init__(self, fmt: str) -> None:
        self.fmt, self.raws = fmt, []

    def strip(self, data: Any) -> Any:
        if isinstance(data, Raw):
            self.raws.append(data)
            return f"__RAW{len(self.raws) - 1}__"
        if isinstance(data, dict):
            return {self.strip(k) if isinstance(k, Raw) else k: self.strip(v) for k, v in data.items()}
        if isinstance(data, list):
            return [self.strip(v) for v in data]
        return data

    def fill(self, text: str) -> str:
        for i, raw in enumerate(self.raws):
            fragment = raw.json if self.fmt == "json" else raw.yaml
            text = text.replace(f'"__RAW{i}__"' if self.fmt == "json" else f"__RAW{i}__", fragment, 1)
        return text


def dump(data: Any, fmt: str = "yaml") -> str:
    ph = _Placeholders(fmt)
    plain = ph.strip(data)
    if fmt == "json":
        text = json.dumps(plain, indent=1, default=str)  # NaN and Infinity as Python writes them
    else:
        text = yaml.dump(plain, Dumper=_DUMPER, sort_keys=False, width=10**9)
    return ph.fill(text)


@dataclass
class Case:
    data: Any
    notes: list[str] = field(default_factory=list)
    files: dict[str, bytes | str] = field(default_factory=dict)
    command: str = "run"
    sets: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    scenario: str = "s.yaml"  # the scenario's file name in the case folder
    text: bytes | str | None = None  # the scenario file's text, when a mutation wrote it raw
    transform: Any = None  # text -> text, applied to the dumped scenario


# ---- mutations ----------------------------------------------------------------------------------------
def _paths(data: Any, prefix=()) -> list[tuple]:
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data[:20]):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _set_path(data: Any, path: tuple, value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _set_dotted(case: Case, dotted: str, value: Any) -> None:
    data = case.data
    if not isinstance(data, dict):
        return
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if isinstance(child, str) and part == "model":
            child = node[part] = {"preset": child}
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def m_value(rng, case):
    paths = _paths(case.data)
    if paths:
        path = rng.choice(paths)
        value = nasty(rng)
        _set_path(case.data, path, value)
        case.notes.append(f"value {'.'.join(map(str, path))} = {value!r:.60}")


def _model_from_file(case) -> bool:
    """The case's model comes from an HF config or a workload file, which model.* dimensions may not join."""
    model = case.data.get("model")
    return isinstance(model, dict) and bool({"hf_config", "workload"} & set(model))


def m_numeric(rng, case):
    key = rng.choice(NUMERIC_KEYS)
    if key.startswith("model.") and _model_from_file(case):
        return
    value = nasty(rng) if rng.random() < 0.3 else rng.choice(
        [0, -1, 2**31, 2**63, 2**64, 10**39, 1e300, 1e308, math.inf, math.nan, 2.0, 64.0, 2.5, 1e-300, 2147483648,
         10**6, 4096, 10**9, True, "8", Raw(".inf"), Raw(".nan"), Raw("12:30"), Raw("2024-01-01")])
    _set_dotted(case, key, value)
    case.notes.append(f"numeric {key} = {value!r:.60}")


def m_choice(rng, case):
    key = rng.choice(CHOICE_KEYS)
    if key.startswith("model.") and _model_from_file(case):
        return
    value = nasty(rng)
    _set_dotted(case, key, value)
    case.notes.append(f"choice {key} = {value!r:.60}")


def m_key(rng, case):
    """An odd key somewhere: of another type, with a newline, very long."""
    targets = [p for p in _paths(case.data) if isinstance(_get_path(case.data, p), dict)]
    node = _get_path(case.data, rng.choice(targets)) if targets and rng.random() < 0.6 else case.data
    if not isinstance(node, dict):
        return
    key = rng.choice([1, 2.5, True, None, "a\nb", "model\n", "k" * 5000, "", "é", "x y", "training.micro_batch",
                      datetime.date(2024, 1, 1), "__proto__", "\x00"])
    node[key] = rng.choice(["y", 1, None, {"a": 1}])
    case.notes.append(f"key {key!r:.40}")


def _get_path(data, path):
    for part in path:
        data = data[part]
    return data


def m_delete(rng, case):
    paths = _paths(case.data)
    if paths:
        path = rng.choice(paths)
        parent = _get_path(case.data, path[:-1])
        if isinstance(parent, dict):
            del parent[path[-1]]
            case.notes.append(f"delete {'.'.join(map(str, path))}")


def m_section(rng, case):
    section = rng.choice(["model", "training", "hardware", "fsdp", "compute", "report", "name",
                          "fsdp.mixed_precision", "hardware.network"])
    value = nasty(rng)
    if isinstance(case.data, dict):
        _set_dotted(case, section, value)
    case.notes.append(f"section {section} = {value!r:.60}")


def _mutate_tree(rng, data: Any, count: int, *, json_ok: bool) -> list[str]:
    notes = []
    for _ in range(count):
        paths = _paths(data)
        if not paths:
            break
        path = rng.choice(paths)
        value = nasty(rng, json_ok=json_ok)
        _set_path(data, path, value)
        notes.append(f"{'.'.join(map(str, path))}={value!r:.40}")
    return notes


def m_hf(rng, case):
    """model: {hf_config: cfg.json}, a shipped config mutated (or not JSON at all)."""
    source = rng.choice(HF_CONFIGS)
    config = json.loads(source.read_text())
    r = rng.random()
    if r < 0.6:
        notes = _mutate_tree(rng, config, rng.choice([1, 1, 2, 3]), json_ok=True)
        text = dump(config, "json")
    elif r < 0.75:
        key = rng.choice(["num_hidden_layers", "hidden_size", "num_local_experts", "num_experts", "vocab_size",
                          "intermediate_size", "num_attention_heads", "image_size", "patch_size", "num_labels",
                          "num_experts_per_tok", "num_key_value_heads", "head_dim", "max_position_embeddings"])
        value = rng.choice([2147483648, 10**39, 1e39, 2**63, 1e300, 2.0, 64.5, 0, -3, True, "32", None, 10**6])
        target = config.get("text_config") if "text_config" in config and rng.random() < 0.5 else config
        target[key] = value
        notes = [f"{key}={value!r}"]
        text = dump(config, "json")
    else:
        text = rng.choice(["", "{", "[1, 2]", "null", "model_type: llama\n", "\xff\xfe{}", _nest(100_000),
                           '{"model_type": "llama", "a": ' + _nest(5000) + "}", "NaN", '{"model_type": NaN}',
                           '{"model_type": ["llama"]}', '{"model_type": {"a": 1}}'])
        notes = [f"text {text[:30]!r}"]
    name = rng.choice(["cfg.json", "config.json", "sub/config.json", "a\nb.json", "c" * 300 + ".json"])
    case.files[name] = text.encode("utf-8", "surrogatepass") if r < 0.75 or not text.startswith("\xff") \
        else b"\xff\xfe{}"
    case.data["model"] = {"hf_config": name}
    if rng.random() < 0.2:
        case.data["model"]["preset"] = "gpt2"
    case.notes.append(f"hf_config {source.name}: {notes}")


_TINY_WORKLOAD: dict | None = None


def _tiny_workload() -> dict:
    global _TINY_WORKLOAD
    if _TINY_WORKLOAD is None:
        from fsdp_sim.workload import TransformerDims, build_transformer

        wl = build_transformer(TransformerDims(hidden=64, layers=2, heads=4, vocab=256), micro_batch=1, seq_len=32,
                               act_dtype="bf16", name="tiny")
        _TINY_WORKLOAD = json.loads(json.dumps(wl.to_dict()))  # tuples as lists
    return copy.deepcopy(_TINY_WORKLOAD)


def _many_modules(data: dict, count: int, fmt: str) -> str:
    """`dump` of `data` with `count` copies of its second module (named layers.i, no parameters) put first.

    The copies differ only in their names, so one copy's text is repeated: dumping thousands of copies
    took 7 s (1,000) to 38 s (5,000) of the test's time, this the same bytes in milliseconds. The copies'
    names are one plain scalar each and the dump never wraps (width 10**9), so a copy's text does not
    depend on its name: A + name0 + B + name1 + C becomes A + name0 + B + name1 + B + ... + C.
    """
    modules = data["modules"]
    marks = ["__COPY0__", "__COPY1__"]
    copies = [copy.deepcopy(modules[1]) | {"name": m, "params": []} for m in marks]  # no shared parts: no YAML anchors
    text = dump(dict(data, modules=copies + modules), fmt)
    head, rest = text.split(marks[0])
    between, tail = rest.split(marks[1])
    return head + between.join(f"layers.{i}" for i in range(count)) + tail


def m_workload(rng, case):
    """model: {workload: wl.yaml}, the tiny model's workload mutated."""
    data = _tiny_workload()
    r = rng.random()
    notes: list = []
    if r < 0.5:
        notes = _mutate_tree(rng, data, rng.choice([1, 1, 2]), json_ok=False)
    elif r < 0.8:
        m = rng.choice(data["modules"])
        key = rng.choice(["saved_bytes", "fwd_temp_bytes", "output_bytes", "fwd_flops", "bwd_flops", "fwd_time_s",
                          "bwd_time_s", "fwd_hbm_bytes"])
        value = rng.choice([2**63, 2**70, 1e300, math.inf, math.nan, 1e-12, 0.0, 2.0, 10**15, -1, 1.5])
        m[key] = value
        notes = [f"{m['name']}.{key}={value!r}"]
        if rng.random() < 0.3:
            data["model_flops"] = rng.choice([1e300, 1e30, 1e20, math.inf, 0.0])
            notes.append(f"model_flops={data['model_flops']}")
        if rng.random() < 0.3 and m["params"]:
            m["params"][0]["shape"] = rng.choice([[2**40, 2**40], [10**20], [2**31, 2**31, 2**31], [64.0, 64],
                                                  [0], [], [-1, 4], [1] * 1000])
            notes.append(f"shape={m['params'][0]['shape']!r:.40}")
    else:
        count = rng.choice([1000, 5000])
        notes = [f"{count + len(data['modules'])} modules"]
    fmt = rng.choice(["yaml", "yaml", "json"])
    name = f"wl.{fmt}"
    case.files[name] = _many_modules(data, count, fmt) if r >= 0.8 else dump(data, fmt)
    case.data["model"] = {"workload": name}
    training = case.data.get("training")
    if isinstance(training, dict) and rng.random() < 0.9:
        training.pop("micro_batch", None)
        training.pop("seq_len", None)
    case.notes.append(f"workload {notes}")


def m_trace(rng, case):
    """compute.trace: the fixture trace with malformed events."""
    case.data = copy.deepcopy(TRACED) if rng.random() < 0.7 else case.data
    trace = json.loads(TRACE_FIXTURE.read_text())
    events = trace["traceEvents"]
    notes = []
    for _ in range(rng.choice([1, 2, 3])):
        r = rng.random()
        e = rng.choice(events)
        if r < 0.3:
            key = rng.choice(["args", "pid", "tid", "name", "cat", "ph"])
            e[key] = rng.choice([5, "x", [], [1], {"a": 1}, None, {"correlation": [1]}, {"correlation": {"a": 1}},
                                 1.5, math.nan, True])
            notes.append(f"event.{key}={e[key]!r}")
        elif r < 0.5:
            key = rng.choice(["ts", "dur"])
            e[key] = rng.choice([math.nan, math.inf, -1.0, 1e300, -1e300, 0, 1e-300, 2**70, True])
            notes.append(f"event.{key}={e[key]!r}")
        elif r < 0.65:
            scale = rng.choice([1e-6, 1e-9, 1e-3, 1e6, 0.0])
            for ev in events:
                ev["dur"] = ev["dur"] * scale
            notes.append(f"dur x {scale}")
        elif r < 0.75:
            e["args"] = {"correlation": rng.choice([1, "1", 1.0, None])}
            e["cat"] = rng.choice(["kernel", "cuda_runtime"])
            e["dur"] = rng.choice([1e-9, 1e12, 5.0])
            notes.append(f"kernel event {e}")
        elif r < 0.85:
            trace = rng.choice([events, {"traceEvents": {"a": 1}}, {"traceEvents": None}, [], 5, "x",
                                {"traceEvents": [5, "x", None, [1]]}])
            notes.append(f"trace {str(trace)[:30]}")
            break
        else:
            e["name"] = rng.choice(["fsdp_sim::::forward", "fsdp_sim::layers.0::backward", "nn.Module: A_1",
                                    "fsdp_sim::a\nb::forward", 5, None, "ProfilerStep#x", "fsdp_sim::" + "x" * 5000
                                    + "::forward"])
            notes.append(f"event.name={e['name']!r:.40}")
    text = dump(trace, "json")
    if rng.random() < 0.08:
        text = rng.choice(["", "{", _nest(100_000), "\xff", "[" + "{}," * 10 + "]"])
    compute = case.data.setdefault("compute", {}) if isinstance(case.data, dict) else {}
    if isinstance(compute, dict):
        compute["trace"] = "trace.json"
    case.files["trace.json"] = text.encode("utf-8", "surrogateescape") if text != "\xff" else b"\xff"
    case.notes.append(f"trace {notes}")


def m_profile(rng, case):
    """hardware.profile: a relative path to a mutated copy of a shipped profile, or an odd name."""
    hardware = case.data.get("hardware") if isinstance(case.data, dict) else None
    if not isinstance(hardware, dict):
        return
    if rng.random() < 0.3:
        hardware["profile"] = rng.choice(["../../etc/passwd", "h100-sxm\n", "x" * 300, "", ".yaml", "/", "/tmp",
                                          "gpu", "profiles/gpu.yaml", "/dev/null.yaml", "a/../h100-sxm.yaml",
                                          "x" * 300 + ".yaml", "h100-sxm.yml"])
        case.notes.append(f"profile name {hardware['profile']!r:.40}")
        return
    source = rng.choice(PROFILES)
    profile = yaml.safe_load(source.read_text())
    key = rng.choice(["memory_bytes", "hbm_bandwidth_Bps", "peak_flops.bf16", "peak_flops.fp32", "peak_flops",
                      "matmul_efficiency", "gpus_per_node", "sm_count", "cuda_context_bytes", "nccl_bytes",
                      "fabric.nccl_channels", "fabric.ring.hop_latency_s", "fabric.ring.all_gather_busbw_Bps",
                      "fabric.network.nic_gbps", "fabric.network.size_curve.size_bytes", "arch", "name"])
    value = rng.choice([math.inf, math.nan, 1e300, 1e308, 1e-300, 5e-324, 2**63, 2**64, 10**30, 0.5, 1.5, 1e39,
                        Raw(".inf"), Raw(".nan"), "x", None, [1, 2], 1, 1e6]) if rng.random() < 0.8 else nasty(rng)
    node = profile
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    sub = rng.choice(["gpu.yaml", "profiles/gpu.yaml"])
    case.files[sub] = dump(profile)
    hardware["profile"] = sub
    hardware.pop("gpus_per_node", None) if rng.random() < 0.5 else None
    case.notes.append(f"profile {source.name} {key}={value!r:.40}")


def m_text(rng, case):
    """The scenario's raw text: tags, alias bombs, deep nesting, bytes that are not UTF-8, nothing."""
    r = rng.random()
    if r < 0.15:
        case.text = rng.choice([b"", b"\n", b"# only a comment\n", b"---\n", b"---\n...\n", b"~\n", b"[]\n", b"5\n",
                                b"\xef\xbb\xbf" + dump(case.data).encode(), b"\xff\xfe\x00m", b"\x00\x01\x02",
                                b"model: llama3-8b\n---\nmodel: gpt2\n", b"model: \"\\ud800\"\n",
                                b"model:\n\t- x\n", b"%YAML 1.1\n---\nmodel: gpt2\n", b"%TAG ! tag:x,2000:\n---\n!a 1\n",
                                dump(case.data).encode() + b"\n\xff\xfe\n", b"\xc3\x28: 1\n"])
        case.notes.append(f"text {case.text[:30]!r}")
        return
    key = rng.choice(NUMERIC_KEYS + CHOICE_KEYS + ["model", "training", "hardware"])
    fragment = rng.choice([_nest(rng.choice([200, 999, 5000, 100_000])), _bomb(9), _bomb(6), "&x [*x]",
                           "!!python/object/apply:os.system [\"touch PWNED\"]", "!!python/object/apply:os.getcwd []",
                           "!!python/name:os.system", "!!binary AAAA", "!!set {a, b}", "!custom {a: 1}",
                           "*nowhere", "{[1, 2]: 3}", "\"\\ud800\"", "!!timestamp 2001-12-14"])
    _set_dotted(case, key, Raw(fragment))
    case.notes.append(f"raw {key} = {fragment[:40]!r}")


def m_path(rng, case):
    """The scenario argument itself: a directory, missing, a very long or odd name."""
    case.scenario = rng.choice(["dir.yaml", "missing.yaml", "s" * 300 + ".yaml", "a\nb.yaml", "s.yaml/x",
                                "sub/s.yaml", "-x.yaml", "s.YAML", "s", " s.yaml", "é.yaml"])
    case.notes.append(f"scenario path {case.scenario!r:.40}")


SET_KEYS = NUMERIC_KEYS + CHOICE_KEYS + ["model", "training", "a.b", "training.micro_batch.x", "name.x",
                                         "model.preset", "fsdp", "1.2", "a\nb", "k" * 400, "_x", "training..x"]
SET_VALUES = ["1", "2", "1,2", "2.0", "1e3", ".inf", ".nan", "-1", "0", "[", "]", "{a", "{a: 1}", "[1, 2]", "a: b",
              "!!python/name:os.system", "!!python/object/apply:os.system [\"touch PWNED\"]", "!!binary AAAA",
              "!!set {a}", "!custom x", "*a", "&a x", "2024-01-01", "2024-01-01T10:00:00", "12:30", "yes", "~", "null",
              "'unterminated", "\"\\ud800\"", "x" * 400, "%", "@x", "`x", "? x", "- x", "a\nb", "9" * 400,
              "9223372036854775808", "per_block", "whole_model", "full", "none", "bf16", "fp8", "true", "false",
              "\t", " ", "#", "|", ">", "!!float x", "!!int x", "[[[[[[[[[[", "{{{{{{", "1" * 10_000_000]


def m_sweep(rng, case):
    case.command = "sweep"
    for _ in range(rng.choice([1, 1, 2])):
        key = rng.choice(SET_KEYS)
        values = ",".join(rng.choice(SET_VALUES) for _ in range(rng.choice([1, 1, 2, 3])))
        text = rng.choice([f"{key}={values}", f"{key}={values}", key, f"={values}", f"{key}=", f"{key}=={values}"])
        case.sets.append(text)
    case.notes.append(f"sweep {[s[:40] for s in case.sets]}")


def m_cli(rng, case):
    r = rng.random()
    if r < 0.4:
        case.args += ["--safety-margin", rng.choice(["nan", "inf", "-inf", "-0", "1", "0.99999999", "1e-320", "x",
                                                     "0x1p-3", "1_0"])]
    elif r < 0.7:
        option = rng.choice(["--json", "--trace", "--timeline-csv"])
        case.args += [option, "@" + rng.choice(["missing/out.json", "dir.yaml", "o" * 300 + ".json", "", "/",
                                                "out\n.json", "s.yaml/x.json"])]
    else:
        case.args += [rng.choice(["--require-fit", "-q", "--bogus", "--json"])]
    case.notes.append(f"args {case.args}")


GRID_KEYS = ["training.micro_batch", "training.seq_len", "fsdp.wrap", "fsdp.backward_prefetch", "report.safety_margin",
             "training.activation_checkpointing", "hardware.nodes"]


def m_grid(rng, case):
    """sweep / recommend --grid FILE with odd axes: ranges of non-finite or huge bounds, bundles, tags, bombs."""
    grid: dict = {}
    for _ in range(rng.choice([1, 1, 2])):
        key = rng.choice(GRID_KEYS + ["wrap", "x", "model", "1", "a\nb"])
        r = rng.random()
        if r < 0.3:
            spec = {"start": rng.choice([1, 0, -1, 1.5, math.inf, math.nan, 10**30, "a", None, True]),
                    "stop": rng.choice([4, 8, 1e300, math.inf, math.nan, 2**63, "b", [1]])}
            extra = rng.choice([None, ("step", rng.choice([1, 0, -1, 1e-300, math.nan, 0.5, 2**63])),
                                ("factor", rng.choice([2, 1.0000001, 1, math.inf, math.nan, 0.5, 10**9]))])
            if extra:
                spec[extra[0]] = extra[1]
        elif r < 0.5:
            spec = [nasty(rng) for _ in range(rng.choice([1, 2]))]
        elif r < 0.65:
            spec = [{"fsdp.wrap": "every_k_blocks", "fsdp.blocks_per_unit": nasty(rng)}, {"fsdp.wrap": "per_block"}]
        elif r < 0.72:
            spec = {"values": rng.choice([[1, 2], [], "x", None, [nasty(rng)], {"a": 1}])}
        elif r < 0.85:  # named choices, each a bundle of keys (the techniques grid's shape)
            spec = {rng.choice(["plain", "a b", "", "x" * 300, "1"]): {rng.choice(GRID_KEYS): nasty(rng)},
                    "checkpointing": {"training.activation_checkpointing": rng.choice(["full", "none", nasty(rng)])}}
        else:
            spec = nasty(rng)
        grid[key] = spec
    case.files["grid.yaml"] = dump(grid) if rng.random() < 0.9 else rng.choice(["", "[", "- a\n", _nest(5000)])
    case.command = rng.choice(["sweep", "sweep", "recommend"])
    tiny = isinstance(case.data.get("model"), dict) and case.data["model"].get("hidden") == 64
    case.args += ["--grid", "@grid.yaml"] + (["--max-batch"] if tiny and rng.random() < 0.2 else [])
    case.notes.append(f"grid {str(grid)[:120]}")


def m_outputs(rng, case):
    """The other ways in and out: run --set, sweep's row formats and --resume, recommend's --save,
    --global-batch and --html, run's --html and --trace."""
    r = rng.random()
    if r < 0.3:
        key, value = rng.choice(SET_KEYS), rng.choice(SET_VALUES)
        case.args += ["--set", rng.choice([f"{key}={value}", f"{key}={value},{value}", key, f"{key}="])]
    elif r < 0.55:
        case.command = "sweep"
        case.sets.append(f"{rng.choice(SET_KEYS)}={rng.choice(SET_VALUES)}")
        case.args += ["-o", "@" + rng.choice(["rows.csv", "rows.jsonl", "rows.json", "rows"])]
        if rng.random() < 0.3:
            case.args.append("--resume")
    elif r < 0.8:
        case.command = "recommend"
        case.sets.append(f"training.micro_batch={rng.choice(['1', '1,2', '2'])}")
        case.args += rng.choice([["--save", "@best.yaml"], ["--global-batch", rng.choice(["8", "0", "-1", "7", "x"])],
                                 ["--html", "@r.html"]])
    else:
        case.args += [rng.choice(["--html", "--trace"]), "@" + rng.choice(["r.html", "t.json"])]
    case.notes.append(f"outputs {case.command} {case.args}")


def m_variation(rng, case):
    """variation's named stragglers, nodes and NICs (odd indices, speeds, bandwidths, shapes), with or without
    `run --per-rank` and its --trace-ranks."""
    sane = {"rank": [0, 1], "node": [0, 1], "nic": [0, 1, 7], "speed": [0.5, 0.9, 1.2], "bandwidth": [0, 0.5, 1]}

    def odd(field):  # a value that runs most often, else an odd one (out of range, of the wrong type, huge)
        r = rng.random()
        return rng.choice(sane[field]) if r < 0.6 else nasty(rng) if r < 0.75 else \
            rng.choice([3, 8, 15, -1, 2**63, 1.5, 1.51, 0.0, True, math.nan])
    var = case.data.setdefault("variation", {})
    if not isinstance(var, dict):
        return
    key = rng.choice(["stragglers", "nodes", "links"])
    fields = {"stragglers": ("rank", "speed"), "nodes": ("node", "speed"), "links": ("node", "nic", "bandwidth")}[key]
    r = rng.random()
    var[key] = ([{f: odd(f) for f in fields if rng.random() < 0.95} for _ in range(rng.choice([1, 1, 2]))] if r < 0.8
                else nasty(rng))
    hardware = case.data.get("hardware")
    if isinstance(hardware, dict) and rng.random() < 0.8:  # nodes and NICs to name
        hardware.update(nodes=rng.choice([1, 2, 2, 4]), gpus_per_node=rng.choice([1, 2, 8]))
    if rng.random() < 0.6:
        case.args.append("--per-rank")
        if rng.random() < 0.3:
            case.args += ["--trace", "@t.json", "--trace-ranks", rng.choice(["0", "0,1", "99", "x", "-1", "0,,1"])]
    case.notes.append(f"variation.{key} = {str(var.get(key))[:80]} {case.args}")


MUTATIONS = [(m_value, 14), (m_numeric, 14), (m_choice, 6), (m_key, 5), (m_delete, 4), (m_section, 5), (m_hf, 10),
             (m_workload, 8), (m_trace, 9), (m_profile, 7), (m_text, 9), (m_path, 2), (m_sweep, 10), (m_cli, 4), (m_grid, 5),
             (m_outputs, 6), (m_variation, 6)]


def make_case(rng: random.Random) -> Case:
    r = rng.random()
    if r < 0.35:
        data = copy.deepcopy(TINY)
    elif r < 0.45:
        data = copy.deepcopy(TRACED)
        data.setdefault("compute", {})
    else:
        data = yaml.safe_load(rng.choice(SCENARIOS).read_text())
    case = Case(data)
    fns, weights = zip(*MUTATIONS)
    for fn in rng.choices(fns, weights, k=rng.choice([1, 1, 1, 2, 2, 3])):
        if isinstance(case.data, dict):
            fn(rng, case)
    if isinstance(case.data, dict) and isinstance(case.data.get("compute"), dict) \
            and case.data["compute"].get("trace") == "trace.json" and "trace.json" not in case.files:
        case.files["trace.json"] = TRACE_FIXTURE.read_bytes()
    return case


# ---- running --------------------------------------------------------------------------------------
def write_case(case: Case, folder: Path) -> list[str]:
    """The case's files under `folder`; returns the argv (paths relative to folder's parent, the cwd)."""
    folder.mkdir(parents=True)
    for name in ("hf", "traced"):
        (folder / name).symlink_to(REPO / "scenarios" / name)
    (folder / "dir.yaml").mkdir()
    for name, content in case.files.items():
        path = folder / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
        except OSError:
            pass  # a name the file system refuses: the run reports it missing
    text = case.text if case.text is not None else dump(case.data)
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    if case.scenario not in ("dir.yaml", "missing.yaml"):
        try:
            (folder / case.scenario).parent.mkdir(parents=True, exist_ok=True)
            (folder / case.scenario).write_bytes(text)
        except OSError:
            pass
    scenario = f"{folder.name}/{case.scenario}"
    out = f"{folder.name}/out.json"
    if case.command == "sweep":
        argv = ["sweep", scenario, "--jobs", "1", "-o", out]
        for s in case.sets:
            argv += ["--set", s]
    elif case.command == "recommend":  # only with a (small) grid: the default space is a hundred points
        argv = ["recommend", scenario, "--jobs", "1", "--json", out]
        for s in case.sets:
            argv += ["--set", s]
    else:
        argv = ["run", scenario, "--json", out]
    return argv + [f"{folder.name}/{a[1:]}" if a.startswith("@") else a for a in case.args]  # @: a file in the folder


def _child(argv: list[str], cwd: Path, out_path: Path, err_path: Path, timeout: float) -> None:
    """In the forked child: run the CLI with stdout/stderr in files, a memory and a time limit."""
    try:
        os.chdir(cwd)
        out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        # as a process started from a shell has them (a test runner may have replaced them)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        limit = 4 << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(1, math.ceil(timeout)))
        from fsdp_sim.cli import main

        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        except BaseException:  # noqa: BLE001 - that is what the fuzzer looks for
            traceback.print_exc()
            rc = 70
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        rc = 70
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            os._exit(71)
    os._exit(rc)


def start(argv: list[str], cwd: Path, folder: Path, timeout: float) -> int:
    pid = os.fork()
    if pid == 0:
        _child(argv, cwd, folder / "_stdout", folder / "_stderr", timeout)
    return pid


_KEY_INT = re.compile(r"(bytes|(?<!use_orig_)params|tokens_per_step|tokens_per_rank|world_size|shard_size|replicate_size|"
                      r"nodes|gpus_per_node|grad_accumulation|modules)$")


def _strict_json(text: str) -> Any:
    def bad(name):
        raise ValueError(f"{name} in JSON")
    return json.loads(text, parse_constant=bad)


def _walk(data: Any, path: str, problems: list[str]) -> None:
    if isinstance(data, dict):
        for k, v in data.items():
            _walk(v, f"{path}.{k}", problems)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _walk(v, f"{path}[{i}]", problems)
    else:
        leaf = path.rsplit(".", 1)[-1]
        if _KEY_INT.search(leaf) and not path.startswith(".swept"):
            if isinstance(data, bool) or not isinstance(data, int):
                if not (data is None and leaf.endswith("_bytes") and path.startswith(".row")):
                    problems.append(f"{path} = {data!r} is not an int")
        if leaf.endswith("_s") and data is not None and not (isinstance(data, (int, float)) and 0 <= data < math.inf):
            problems.append(f"{path} = {data!r} is not a finite time")
        if leaf in ("mfu", "overlap_fraction") and data is not None and not (isinstance(data, (int, float)) and 0 <= data <= 1):
            problems.append(f"{path} = {data!r} is outside [0, 1]")
        if isinstance(data, float) and not math.isfinite(data):
            problems.append(f"{path} = {data!r}")


def check_run_json(text: str) -> list[str]:
    problems: list[str] = []
    data = _strict_json(text)
    _walk(data, "", problems)
    mem = data["memory"]
    if mem["headroom_bytes"] != mem["budget_bytes"] - mem["required_bytes"]:
        problems.append(f"headroom {mem['headroom_bytes']} != budget - required "
                        f"{mem['budget_bytes'] - mem['required_bytes']}")
    if mem["within_budget"] != (mem["required_bytes"] <= mem["budget_bytes"]):
        problems.append("within_budget disagrees with required <= budget")
    if mem["fits"] != (mem["required_bytes"] <= mem["capacity_bytes"]):
        problems.append("fits disagrees with required <= capacity")
    if data["peak"]["allocated_bytes"] < 0:
        problems.append("negative peak")
    return problems


def check_rows(text: str) -> list[str]:
    problems: list[str] = []
    rows = _strict_json(text)
    from fsdp_sim.sweep import COLUMNS

    for i, row in enumerate(rows):
        figures = {k: v for k, v in row.items() if k in COLUMNS}
        _walk(figures, f".row[{i}]", problems)
        error = row.get("error") or ""
        if "\n" in error or len(error.splitlines()) > 1:
            problems.append(f"row {i}: multi-line error")
        if not error and row.get("headroom_bytes") is not None and row["within_budget"] != (row["headroom_bytes"] >= 0):
            problems.append(f"row {i}: within_budget disagrees with headroom")
        if not error and row.get("within_budget") and not row["fits"]:
            problems.append(f"row {i}: within the budget but does not fit")
    return problems


def _signature(err: str) -> str:
    """A traceback as its exception line and the innermost fsdp_sim frame (one kind of failure)."""
    frames = re.findall(r'File "([^"]*fsdp_sim[^"]*)", line (\d+), in (\S+)', err)
    last = [line for line in err.strip().splitlines() if line and not line.startswith(" ")]
    where = f"{frames[-1][0].split('fsdp_sim/')[-1]}:{frames[-1][1]} {frames[-1][2]}" if frames else "?"
    line = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", last[-1] if last else "?")
    return f"{line[:160]} @ {where}"


def check_recommendation(text: str) -> list[str]:
    data = _strict_json(text)
    return check_rows(json.dumps(data.get("rows", [])))


def classify(rc: int | None, signaled: int | None, out: str, err: str, folder: Path, argv: list[str]) -> tuple[str, str]:
    """(outcome, detail) of one finished case."""
    if (folder / "PWNED").exists() or (folder.parent / "PWNED").exists():
        return "code ran", "a YAML tag ran os.system"
    if signaled == signal.SIGALRM:
        return "hang", ""
    if signaled is not None:
        return "crash", f"signal {signaled}"
    if "Traceback (most recent call last)" in err or rc not in (0, 1, 2):
        return "traceback", _signature(err)
    # a warning is one line of its own (`fsdp-sim: warning: ...`): the rest of stderr is judged without them
    said = err.splitlines(keepends=True)
    if any(len(line.rstrip("\n")) > MAX_ERROR for line in said if line.startswith("fsdp-sim: warning: ")):
        return "long error", "a warning line past the limit"
    err = "".join(line for line in said if not line.startswith("fsdp-sim: warning: "))
    if rc == 2:
        lines = err.splitlines()
        if len(lines) != 1 or err.count("\n") != 1:
            return "multi-line error", err[:600]
        if len(lines[0]) > MAX_ERROR:
            return "long error", f"{len(lines[0])} chars: {lines[0][:200]}"
        if not lines[0].startswith("fsdp-sim: error: "):
            return "multi-line error", lines[0][:300]
        return "clean error", lines[0]
    # 0 or 1: a result
    if err.strip() and (len(err.splitlines()) > 1 or len(err) > MAX_ERROR + 1):
        return "multi-line error", err[:600]
    out_json = folder / "out.json"
    if "--json" in argv or "-o" in argv:
        option = "--json" if "--json" in argv else "-o"
        target = argv[len(argv) - 1 - argv[::-1].index(option) + 1]  # the last one given wins
        if target.endswith("out.json") and not (folder.parent / target).is_file() and rc == 0:
            return "invalid figure", "no output file written at exit 0"
    try:
        if out_json.is_file():
            text = out_json.read_text()
            problems = {"sweep": check_rows, "recommend": check_recommendation}.get(argv[0], check_run_json)(text)
            if problems:
                return "invalid figure", "; ".join(problems[:4])
    except (ValueError, KeyError, TypeError) as exc:
        return "invalid figure", f"{type(exc).__name__}: {exc}"[:300]
    m = re.search(r"MFU (\S+) %", out)
    if m and not (0 <= float(m.group(1)) <= 100):
        return "invalid figure", f"MFU {m.group(1)} % printed"
    if re.search(r"\b(nan|inf)\b", out, re.IGNORECASE) and argv[0] == "run":
        return "invalid figure", "nan/inf printed in the summary"
    return "ok", ""


def run_cases(cases: list[tuple[int, Case]], root: Path, *, jobs: int = 1, timeout: float = 10.0,
              on_result=None) -> list[tuple[int, str, str, list[str]]]:
    """Run the cases (an iterable) `jobs` at a time in forked children; returns (index, outcome, detail,
    argv) per case."""
    from fsdp_sim import cli  # noqa: F401 - imported once here, shared by every fork
    from fsdp_sim import scenario, simulate, sweep  # noqa: F401
    from fsdp_sim.results import export, report  # noqa: F401

    results = []
    todo = iter(cases)
    running: dict[int, tuple[int, Case, Path, list[str], float]] = {}
    more = True
    while more or running:
        while more and len(running) < jobs:
            item = next(todo, None)
            if item is None:
                more = False
                break
            index, case = item
            folder = root / f"case{index}"
            argv = write_case(case, folder)
            pid = start(argv, root, folder, timeout)
            running[pid] = (index, case, folder, argv, time.monotonic())
        if not running:
            break
        pid, status = os.wait()
        if pid not in running:
            continue
        index, case, folder, argv, began = running.pop(pid)
        rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        out = (folder / "_stdout").read_text(errors="replace")
        err = (folder / "_stderr").read_text(errors="replace")
        outcome, detail = classify(rc, sig, out, err, folder, argv)
        results.append((index, outcome, detail, argv))
        if on_result:
            on_result(index, case, outcome, detail, argv, time.monotonic() - began)
        shutil.rmtree(folder, ignore_errors=True)
        for stray in ("PWNED",):
            (root / stray).unlink(missing_ok=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=500, help="cases to run (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="cases at a time (default 1)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per case before it counts as a hang")
    parser.add_argument("--show", type=int, default=3, help="cases to show per bad outcome (default 3)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    rng = random.Random(args.seed)
    cases = ((i, make_case(rng)) for i in range(args.n))  # made as they run: a few hold 10 MB strings
    counts: Counter = Counter()
    kinds: Counter = Counter()  # traceback signature -> cases
    shown: dict[str, list[str]] = {}
    slow: list[tuple[float, int]] = []
    began = time.monotonic()

    def report(index, case, outcome, detail, argv, seconds):
        counts[outcome] += 1
        slow.append((seconds, index))
        if outcome == "traceback":
            kinds[detail] += 1
            if kinds[detail] > 1:
                return
        if outcome not in GOOD and len(shown.setdefault(outcome, [])) < args.show * (4 if outcome == "traceback" else 1):
            shown[outcome].append(f"  case {index}: {'; '.join(case.notes)[:300]}\n    argv: {[a[:60] for a in argv]}\n"
                                  f"    {detail.strip()[-900:]}")

    with tempfile.TemporaryDirectory(prefix="fsdp-fuzz-") as tmp:
        run_cases(cases, Path(tmp), jobs=args.jobs, timeout=args.timeout, on_result=report)
    elapsed = time.monotonic() - began
    print(f"fuzz: {args.n} cases, seed {args.seed}, {elapsed:.0f} s")
    for outcome in ("ok", "clean error", "traceback", "hang", "invalid figure", "multi-line error", "long error",
                    "code ran", "crash"):
        print(f"  {outcome:<18}{counts[outcome]:>7}")
    for outcome, lines in shown.items():
        print(f"\n{outcome}:")
        print("\n".join(lines))
    if kinds:
        print(f"\ntraceback kinds ({len(kinds)}):")
        for sig, n in kinds.most_common():
            print(f"  {n:>5}  {sig}")
    slow.sort(reverse=True)
    print(f"\nslowest: {', '.join(f'case {i} {s:.1f} s' for s, i in slow[:5])}")
    return 0 if all(counts[o] == 0 for o in counts if o not in GOOD) else 1


if __name__ == "__main__":
    sys.exit(main())
