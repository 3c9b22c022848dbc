"""Sweep grids: which scenario keys take which values, from a grid file and `--set`.

A grid file is YAML, one axis per dotted scenario key:

    training.micro_batch: {start: 1, stop: 8}          # 1, 2, ..., 8 (stop included; step defaults to 1)
    training.seq_len: {start: 1024, stop: 8192, factor: 2}   # 1024, 2048, 4096, 8192
    fsdp.backward_prefetch: [true, false]
    training.activation_checkpointing: {values: [none, full]}
    fsdp.wrap: per_block                               # one value: set on every point
    wrap:                                              # a plain name: settings chosen together
      - {fsdp.wrap: per_block}
      - {fsdp.wrap: every_k_blocks, fsdp.blocks_per_unit: 2}
    technique:                                         # ... or named: the rows show the name
      checkpointing: {training.activation_checkpointing: full}
      lora: {model.lora: {rank: 16}}

The points are the cartesian product of the axes in file order, `--set` axes last. An axis of `--set`
replaces every grid axis that sets the same key. Bad grids raise `ScenarioError` naming the key.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from fsdp_sim.datafile import SAFE_LOADER, check_tree, read_data
from fsdp_sim.errors import ScenarioError, show

# a scenario's top-level keys (scenario.py's parse_scenario)
SECTIONS = ("name", "model", "training", "hardware", "fsdp", "compute", "report", "parallelism", "allocator")
MAX_POINTS = 1_000_000
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_RANGE_KEYS = {"start", "stop", "step", "factor"}


@dataclass(frozen=True, slots=True)
class Axis:
    """One dimension of a sweep: a name and its options, each a mapping of dotted keys to values;
    `labels`: the options' names when the grid named them (the rows show the name, not the keys)."""

    name: str
    options: tuple[dict[str, Any], ...]
    labels: tuple[str, ...] = ()

    @classmethod
    def of(cls, key: str, values) -> Axis:
        return cls(key, tuple({key: v} for v in values))

    @property
    def keys(self) -> list[str]:
        return list(dict.fromkeys(k for option in self.options for k in option))

    @property
    def columns(self) -> list[str]:
        return [self.name] if self.labels else self.keys

    def chosen(self, i: int) -> dict[str, Any]:
        """Option i as a point sets it, with its name under the axis' when it has one."""
        return self.options[i] | ({self.name: self.labels[i]} if self.labels else {})


MAX_ASSIGNMENT = 10_000  # characters of one --set


def _yaml_value(key: str, text: str) -> Any:
    """One `--set` value: YAML read with the safe loader (no tag runs code), then checked as a grid value."""
    try:
        value = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        hint = ("expected a YAML flow list or mapping, e.g. [{rank: 17, speed: 0.9}]" if text.lstrip()[:1] in _CLOSE
                else "quote a string")
        raise ScenarioError(f"--set {key}: {show(text)} is not a YAML value ({problem}); {hint}") from None
    except (ValueError, OverflowError, RecursionError) as exc:  # a tag's bad content, a 5,000-digit number
        raise ScenarioError(f"--set {key}: {show(text)} is not a YAML value ({str(exc).split(';')[0]})") from None
    check_value(f"--set {key}", value)
    return value


def check_value(where: str, value: Any) -> None:
    """A value a sweep sets and writes into its rows: a number (finite), a string (printable), true/false,
    null, or a list or mapping of them (string keys); not a date, bytes or a set, which no scenario key takes."""
    check_tree(value, where)
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, float) and not math.isfinite(v):
            raise ScenarioError(f"{where}: {v!r} is not a finite number")
        elif isinstance(v, str) and not v.isprintable():
            raise ScenarioError(f"{where}: {show(v)} is not a printable one-line string")
        elif v is not None and not isinstance(v, (bool, int, float, str)):
            raise ScenarioError(f"{where}: {show(v)} is a {type(v).__name__}, expected a number, a string, "
                                "true/false or null (quote it to make it a string)")


def parse_assignment(text: str) -> tuple[str, list[Any]]:
    """`key.path=v1,v2` -> ("key.path", [v1, v2]); values are YAML (1 -> int, true -> bool), and a value may be
    a flow list or mapping, whose commas do not split: `variation.stragglers=[{rank: 17, speed: 0.9}]` is one."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ScenarioError(f"--set {show(text)}: expected KEY=VALUE[,VALUE...], e.g. fsdp.wrap=per_block,whole_model")
    _check_key("--set", key)
    if len(text) > MAX_ASSIGNMENT:
        raise ScenarioError(f"--set {key}: {len(text):,} characters, past the limit of {MAX_ASSIGNMENT:,}")
    return key, [_yaml_value(key, v) for v in _split_values(key, values)]


_CLOSE = {"[": "]", "{": "}"}
_OPENS_VALUE = ("", "[", "{", ",", ":")  # the character before a value: none, or a flow indicator


def _split_values(key: str, text: str) -> list[str]:
    """`text` cut at the commas outside brackets, braces and quotes: the sweep's axis values, each a YAML value.
    As in YAML, a quote or bracket opens only where a value starts (first, or after `[{,:` inside a collection),
    so `it's` and `a[1]` stay plain strings."""
    parts, start, stack, quote, prev = [], 0, [], None, ""
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                if quote == "'" and text[i + 1:i + 2] == "'":  # '' is a quote inside a single-quoted scalar
                    i += 1
                else:
                    quote = None
        elif c in "'\"" and prev in _OPENS_VALUE:
            quote = c
        elif c in _CLOSE and (stack or not prev):  # outside a collection only a value's start opens one
            stack.append(_CLOSE[c])
        elif c in "]}" and stack:
            if stack.pop() != c:
                raise ScenarioError(f"--set {key}: {show(text)} has an unmatched {c!r}; expected a YAML value "
                                    "such as [1, 2] or {rank: 17, speed: 0.9}")
        elif c == "," and not stack:
            parts.append(text[start:i])
            start, prev = i + 1, ""
            i += 1
            continue
        if not c.isspace():
            prev = c
        i += 1
    if quote or stack:
        what = f"quote {quote!r}" if quote else repr({"]": "[", "}": "{"}[stack[-1]])
        raise ScenarioError(f"--set {key}: {show(text)} has an unclosed {what}; expected a YAML value such as "
                            "[1, 2] or {rank: 17, speed: 0.9} (quote the whole --set for the shell)")
    return parts + [text[start:]]


def _check_key(where: str, key: Any) -> None:
    if not isinstance(key, str) or len(key) > 200 or not _DOTTED.fullmatch(key):
        raise ScenarioError(f"{where}: {show(key)} is not a dotted scenario key such as training.micro_batch")


def _number(where: str, spec: dict, key: str, default=None):
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= 1e18:
        raise ScenarioError(f"{where}.{key}: expected a finite number of at most 1e18, got {show(value)}")
    return value


def _range(where: str, spec: dict) -> list:
    """{start, stop[, step | factor]}: stop included; `factor` multiplies instead of adding."""
    extra = sorted(set(spec) - _RANGE_KEYS)
    if extra:
        raise ScenarioError(f"{where}.{extra[0]}: unknown key, expected one of {sorted(_RANGE_KEYS)} or values")
    if "step" in spec and "factor" in spec:
        raise ScenarioError(f"{where}: give step or factor, not both")
    start, stop = _number(where, spec, "start"), _number(where, spec, "stop")
    if stop < start:
        raise ScenarioError(f"{where}: stop {stop} is below start {start}")
    out = []
    if "factor" in spec:
        factor = _number(where, spec, "factor")
        if factor <= 1 or start <= 0:
            raise ScenarioError(f"{where}: factor {factor} must exceed 1 and start {start} be positive")
        value = start
        while value <= stop * (1 + 1e-9) and len(out) <= MAX_POINTS:
            out.append(value)
            value *= factor
    else:
        step = _number(where, spec, "step", 1)
        if step <= 0:
            raise ScenarioError(f"{where}.step: must be positive, got {step}")
        count = (stop - start) / step + 1e-9 + 1  # a float: a 1e-300 step must not become a huge int
        if count > MAX_POINTS:
            raise ScenarioError(f"{where}: {count:,.0f} values, more than {MAX_POINTS:,}")
        count = int(count)
        out = [start + i * step for i in range(count)]
        if all(isinstance(v, int) for v in (start, step)):
            out = [int(v) for v in out]
        else:
            out = [round(v, 12) for v in out]  # 0.1 + 2 * 0.05 is 0.2, not 0.20000000000000004
    return out


def _values(where: str, spec: Any) -> list:
    if isinstance(spec, list):
        values = spec
    elif isinstance(spec, dict):
        if set(spec) == {"values"}:
            values = spec["values"]
            if not isinstance(values, list):
                raise ScenarioError(f"{where}.values: expected a list, got {values!r}")
        elif "values" in spec:
            raise ScenarioError(f"{where}: values goes alone, not beside {sorted(set(spec) - {'values'})}")
        else:
            values = _range(where, spec)
    else:
        values = [spec]
    if not values:
        raise ScenarioError(f"{where}: no values")
    return values


def _bundle(name: str, spec: Any) -> Axis:
    where = f"grid: {name}"
    labels: tuple[str, ...] = ()
    if isinstance(spec, dict) and spec:  # named choices
        labels = tuple(spec)
        for label in labels:
            if not isinstance(label, str) or not label.isprintable() or not 0 < len(label) <= 60:
                raise ScenarioError(f"{where}: {show(label)} is not a choice name (a printable string of 1-60 characters)")
        spec = list(spec.values())
    if not isinstance(spec, list) or not spec or not all(isinstance(o, dict) and o for o in spec):
        raise ScenarioError(f"{where}: a plain name (not a scenario section) takes a list of mappings of dotted "
                            f"keys set together, e.g. - {{fsdp.wrap: every_k_blocks, fsdp.blocks_per_unit: 2}}, "
                            f"or a mapping of choice names to them")
    for option in spec:
        for key in option:
            _check_key(where, key)
            if "." not in key and key not in SECTIONS:
                raise ScenarioError(f"{where}: {show(key)} is not a dotted scenario key such as training.micro_batch")
    return Axis(name, tuple(dict(o) for o in spec), labels)


def parse_grid(data: Any) -> list[Axis]:
    """The axes of a grid file's content (a mapping of dotted keys or named choices)."""
    if not isinstance(data, dict) or not data:
        raise ScenarioError("grid: expected a mapping of dotted scenario keys to values, "
                            "e.g. training.micro_batch: [1, 2, 4]")
    axes = []
    for key, spec in data.items():
        _check_key("grid", key)
        if "." not in key and key not in SECTIONS:
            axes.append(_bundle(key, spec))
        else:
            axes.append(Axis.of(key, _values(f"grid: {key}", spec)))
    return _check_disjoint(axes)


def load_grid(path: str) -> list[Axis]:
    return parse_grid(read_data(path, "--grid"))


def _check_disjoint(axes: list[Axis]) -> list[Axis]:
    owner: dict[str, str] = {}
    for axis in axes:
        for key in axis.keys:
            if key in owner:
                raise ScenarioError(f"grid: {key} is set by both {owner[key]!r} and {axis.name!r}")
            owner[key] = axis.name
    return axes


def combine(axes: list[Axis], assignments: list[str]) -> list[Axis]:
    """The grid's axes with each `--set KEY=...` replacing every axis that sets KEY, appended last."""
    for axis in axes:  # a grid file's values go into the rows too
        for option in axis.options:
            for key, value in option.items():
                check_value(f"grid: {key}", value)
    out = list(axes)
    for text in assignments:
        key, values = parse_assignment(text)
        out = [a for a in out if key not in a.keys] + [Axis.of(key, values)]
    out = _check_disjoint(out)
    count = 1
    for axis in out:
        count *= len(axis.options)
    if count > MAX_POINTS:
        raise ScenarioError(f"grid: {count:,} points, more than {MAX_POINTS:,}; sweep fewer values")
    return out


def columns(axes: list[Axis]) -> list[str]:
    """The swept keys (a named axis: its name), as row columns, in axis order."""
    return list(dict.fromkeys(k for axis in axes for k in axis.columns))


def combinations(axes: list[Axis]) -> list[dict[str, Any]]:
    """Every point as {dotted key: value} of the keys its options set, the last axis varying fastest."""
    out = []
    for combo in itertools.product(*(range(len(axis.options)) for axis in axes)):
        chosen: dict[str, Any] = {}
        for axis, i in zip(axes, combo):
            chosen.update(axis.chosen(i))
        out.append(chosen)
    return out
