"""Reading the data files a user hands over (scenarios, profiles, workloads, configs, traces).

One place turns a missing file or unparsable text into the one-line `ScenarioError` that names the
scenario key that pointed at it: a path that is a directory, unreadable or too long for the file system,
text that is not UTF-8, YAML or JSON that does not parse, an empty file. What parses is checked for the
shapes no data file of fsdp-sim has and every later step would trip over (`check_tree`): nesting deeper
than `MAX_DEPTH`, YAML aliases that expand past `MAX_EXPANDED` values (an alias bomb) or refer to
themselves, mapping keys that are not strings, and NaN or Infinity in JSON. YAML is read with the safe
loader only: no tag constructs a Python object.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.scientific import from_scientific

SAFE_LOADER = _SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's safe loader when PyYAML has it
MAX_DEPTH = 32  # levels of nested lists and mappings; fsdp-sim's own files use at most 6
MAX_EXPANDED = 1_000_000  # values that YAML aliases may add beyond those written out
# PyYAML parses about 1 MB/s (even with libyaml), JSON a hundred times faster: a large file is JSON
MAX_YAML_BYTES, MAX_JSON_BYTES = 4 << 20, 512 << 20


def reject_unknown_keys(where: str, data: dict, allowed) -> None:
    """The first key of `data` not in `allowed`, as `<where>.<key>: unknown key, ...`."""
    prefix = f"{where}." if where else ""
    for key in data:
        if not isinstance(key, str) or key not in allowed:
            raise ScenarioError(f"{prefix}{key}: unknown key, expected one of {sorted(allowed)}")


MISSING = object()  # get_key's default: the key is required


def expect_mapping(section: str, data: Any) -> dict:
    """`data` as a section's mapping: nothing (null) is an empty one, anything else but a mapping is refused."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{section}: expected a mapping, got {type(data).__name__}")
    return data


def get_key(section: str, data: dict, key: str, kind: type, default=MISSING, *, choices=None, positive=False,
            maximum=None):
    """`data[key]` checked: of `kind` (an int may be written 2.0, a float as an int; floats are finite),
    in `choices`, positive, at most `maximum` (a stated limit, so absurd sizes are refused before any work).
    Every section's parser uses it, the scenario's and each feature's beside its feature: it lives here, below
    them all, so that the imports run one way."""
    value = from_scientific(data.get(key, default), kind)  # 1e8: a string to YAML 1.1, a number here when exact
    where = f"{section}.{key}"
    if value is MISSING:
        raise ScenarioError(f"{where}: missing (required)")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 1 << 1000 else math.inf
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if value is None:
        if default is None:  # the key is optional and null means "not set"
            return None
        raise ScenarioError(f"{where}: expected {kind.__name__}, got nothing (null)")
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind, kind.__name__)
        raise ScenarioError(f"{where}: expected {expected}, got {show(value)}")
    if kind is float and not math.isfinite(value):
        raise ScenarioError(f"{where}: expected a finite number, got {value!r}")
    if choices is not None and value not in choices:
        raise ScenarioError(f"{where}: {show(value)} is not one of {list(choices)}")
    if positive and value <= 0:
        raise ScenarioError(f"{where}: must be positive, got {show(value)}")
    if maximum is not None and value > maximum:
        raise ScenarioError(f"{where}: {show(value)} is past the limit of {maximum:,}")
    return value


def check_mapping(where: str, data: Any, required: set[str], optional: set[str] = frozenset()) -> dict:
    """`data` as a mapping with every `required` key and no key outside `required | optional` (profile
    sections: every figure must be there, a misspelt one must not pass unseen)."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: must be a mapping")
    if unknown := sorted(map(str, set(data) - required - optional)):
        raise ScenarioError(f"{where}.{unknown[0]}: unknown key, expected {sorted(required | optional)}")
    if missing := sorted(required - set(data)):
        raise ScenarioError(f"{where}.{missing[0]}: missing")
    return data


def check_tree(data: Any, key: str, *, strict_keys: bool = True) -> None:
    """Refuse nesting deeper than MAX_DEPTH, an alias expansion past MAX_EXPANDED values, a value that
    contains itself, and (`strict_keys`) a mapping key that is not a string. Each shared list or mapping is
    visited once, so an alias bomb costs what its text costs."""
    if not isinstance(data, (dict, list)):
        return
    memo: dict[int, tuple[int, int]] = {}  # id -> (depth, values when expanded)
    open_: set[int] = set()  # the containers on the path from the root to the one being visited
    distinct = 0
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, done = stack.pop()
        children = list(node.values()) if isinstance(node, dict) else node
        if done:
            open_.discard(id(node))
            depth, size = 0, 1
            for child in children:
                d, s = memo.get(id(child), (0, 1)) if isinstance(child, (dict, list)) else (0, 1)
                depth, size = max(depth, d), size + s
            memo[id(node)] = (depth + 1, size)
            if depth + 1 > MAX_DEPTH:
                raise ScenarioError(f"{key}: nested deeper than {MAX_DEPTH} levels of lists and mappings")
            if size - distinct > MAX_EXPANDED:
                raise ScenarioError(f"{key}: YAML aliases expand to more than {MAX_EXPANDED:,} values "
                                    "(an alias bomb?); write the values out")
            continue
        if id(node) in memo:
            continue
        if id(node) in open_:
            raise ScenarioError(f"{key}: a YAML alias refers to a value that contains it (a cycle)")
        if len(open_) >= MAX_DEPTH:
            raise ScenarioError(f"{key}: nested deeper than {MAX_DEPTH} levels of lists and mappings")
        if isinstance(node, dict) and strict_keys:
            for k in node:
                if not isinstance(k, str):
                    raise ScenarioError(f"{key}: mapping key {show(k)} is a {type(k).__name__}, expected a string "
                                        f"(quote it)")
        open_.add(id(node))
        distinct += len(children) + 1
        stack.append((node, True))
        stack.extend((c, False) for c in children if isinstance(c, (dict, list)) and id(c) not in memo)


def _check_depth(data: Any, key: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH (the cheap check, for JSON)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ScenarioError(f"{key}: nested deeper than {MAX_DEPTH} levels of lists and mappings")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _problem(exc: yaml.YAMLError) -> str:
    """A YAML error as `problem at line L, column C` (one line)."""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_data(path: str | Path, key: str, *, fmt: str = "yaml") -> Any:
    """The parsed content of a YAML (a superset of JSON) or JSON file (`fmt="json"` or a `.json` name);
    `key` names it in errors."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        fmt = "json"  # JSON is YAML too, but the JSON parser reads it a hundred times faster
    try:
        kind = "directory" if path.is_dir() else "file" if path.is_file() else "other" if path.exists() else None
        size = path.stat().st_size if kind == "file" else 0
    except (OSError, ValueError) as exc:  # ValueError: a NUL character in the path
        raise ScenarioError(f"{key}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if kind is None:
        raise ScenarioError(f"{key}: file not found: {path}")
    if kind != "file":
        raise ScenarioError(f"{key}: {path} is {'a directory' if kind == 'directory' else 'not a regular file'}, "
                            "expected a file")
    limit = MAX_JSON_BYTES if fmt == "json" else MAX_YAML_BYTES
    if size > limit:
        hint = "" if limit == MAX_JSON_BYTES else "; write it as JSON (a .json file), which reads much faster"
        raise ScenarioError(f"{key}: {path} is {size / (1 << 20):.1f} MiB, past the limit of {limit >> 20} MiB{hint}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{key}: {path} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})") \
            from None
    what = "JSON" if fmt == "json" else "YAML"
    try:
        data = json.loads(text, parse_constant=_no_constant) if fmt == "json" else yaml.load(text, Loader=_SAFE_LOADER)
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{key}: {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") \
            from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{key}: {path} is not valid YAML ({_problem(exc)})") from None
    except RecursionError:
        raise ScenarioError(f"{key}: {path} is nested deeper than {MAX_DEPTH} levels of lists and mappings") from None
    except (ValueError, OverflowError) as exc:  # a number past Python's limits, NaN in JSON
        raise ScenarioError(f"{key}: {path} is not valid {what} ({str(exc).split(';')[0]})") from None
    if data is None:
        raise ScenarioError(f"{key}: {path} is empty (no {what} document)")
    if fmt == "json":
        _check_depth(data, f"{key}: {path}")  # JSON has no aliases and only string keys
    else:
        check_tree(data, f"{key}: {path}")
    return data
