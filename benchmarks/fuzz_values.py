"""The fuzzer's raw material (`benchmarks/fuzz.py`): the shipped inputs a case starts from, the keys it aims
at, the adversarial values it puts in (huge, non-finite, of the wrong type, nested, tagged, very long) and
the writing of a case's data as YAML or JSON with raw fragments put in verbatim."""

from __future__ import annotations

import datetime
import json
import math
import random
from pathlib import Path
from typing import Any

import yaml


REPO = Path(__file__).resolve().parents[1]
SCENARIOS = sorted(p for p in (REPO / "scenarios").glob("*.yaml") if not p.name.endswith(".grid.yaml"))  # grids are sweep axes
HF_CONFIGS = sorted((REPO / "scenarios" / "hf").glob("*.json"))
PROFILES = sorted((REPO / "hardware_profiles").glob("*.yaml"))
TRACE_FIXTURE = REPO / "tests" / "fixtures" / "profile_reference.json"
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


def nest(depth: int) -> str:
    return "[" * depth + "]" * depth


def bomb(levels: int = 9) -> str:
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
        return Raw(nest(depth))
    if r < 0.84 and not json_ok:
        return Raw(bomb(rng.choice([4, 9])))
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


def tree_paths(data: Any, prefix=()) -> list[tuple]:
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.append(prefix + (k,))
            out += tree_paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data[:20]):
            out.append(prefix + (i,))
            out += tree_paths(v, prefix + (i,))
    return out


def set_path(data: Any, path: tuple, value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def get_path(data, path):
    for part in path:
        data = data[part]
    return data


def mutate_tree(rng, data: Any, count: int, *, json_ok: bool) -> list[str]:
    notes = []
    for _ in range(count):
        paths = tree_paths(data)
        if not paths:
            break
        path = rng.choice(paths)
        value = nasty(rng, json_ok=json_ok)
        set_path(data, path, value)
        notes.append(f"{'.'.join(map(str, path))}={value!r:.40}")
    return notes
