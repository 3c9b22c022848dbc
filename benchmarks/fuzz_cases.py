"""A fuzz case and the mutations that make it (`benchmarks/fuzz.py`): the scenario's values, keys and sections,
its raw text and path, the command's `--set` values, arguments and grids, the outputs and the variation
section; the files it points at are `fuzz_files.py`'s."""

from __future__ import annotations

import copy
import datetime
import math
import random
from dataclasses import dataclass, field
from typing import Any

import yaml

from fuzz_files import m_hf, m_profile, m_trace, m_workload
from fuzz_values import (CHOICE_KEYS, NUMERIC_KEYS, SCENARIOS, TINY, TRACE_FIXTURE, TRACED, Raw, bomb, dump, get_path,
                         nasty, nest, set_path, tree_paths)


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


def set_dotted(case: Case, dotted: str, value: Any) -> None:
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
    paths = tree_paths(case.data)
    if paths:
        path = rng.choice(paths)
        value = nasty(rng)
        set_path(case.data, path, value)
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
    set_dotted(case, key, value)
    case.notes.append(f"numeric {key} = {value!r:.60}")


def m_choice(rng, case):
    key = rng.choice(CHOICE_KEYS)
    if key.startswith("model.") and _model_from_file(case):
        return
    value = nasty(rng)
    set_dotted(case, key, value)
    case.notes.append(f"choice {key} = {value!r:.60}")


def m_key(rng, case):
    """An odd key somewhere: of another type, with a newline, very long."""
    targets = [p for p in tree_paths(case.data) if isinstance(get_path(case.data, p), dict)]
    node = get_path(case.data, rng.choice(targets)) if targets and rng.random() < 0.6 else case.data
    if not isinstance(node, dict):
        return
    key = rng.choice([1, 2.5, True, None, "a\nb", "model\n", "k" * 5000, "", "é", "x y", "training.micro_batch",
                      datetime.date(2024, 1, 1), "__proto__", "\x00"])
    node[key] = rng.choice(["y", 1, None, {"a": 1}])
    case.notes.append(f"key {key!r:.40}")


def m_delete(rng, case):
    paths = tree_paths(case.data)
    if paths:
        path = rng.choice(paths)
        parent = get_path(case.data, path[:-1])
        if isinstance(parent, dict):
            del parent[path[-1]]
            case.notes.append(f"delete {'.'.join(map(str, path))}")


def m_section(rng, case):
    section = rng.choice(["model", "training", "hardware", "fsdp", "compute", "report", "name",
                          "fsdp.mixed_precision", "hardware.network"])
    value = nasty(rng)
    if isinstance(case.data, dict):
        set_dotted(case, section, value)
    case.notes.append(f"section {section} = {value!r:.60}")


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
    fragment = rng.choice([nest(rng.choice([200, 999, 5000, 100_000])), bomb(9), bomb(6), "&x [*x]",
                           "!!python/object/apply:os.system [\"touch PWNED\"]", "!!python/object/apply:os.getcwd []",
                           "!!python/name:os.system", "!!binary AAAA", "!!set {a, b}", "!custom {a: 1}",
                           "*nowhere", "{[1, 2]: 3}", "\"\\ud800\"", "!!timestamp 2001-12-14"])
    set_dotted(case, key, Raw(fragment))
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
    case.files["grid.yaml"] = dump(grid) if rng.random() < 0.9 else rng.choice(["", "[", "- a\n", nest(5000)])
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
