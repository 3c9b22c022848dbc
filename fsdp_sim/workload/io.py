"""A workload as a file: `save_workload` writes YAML (JSON for a `.json` path), `load_workload` reads either.

The file is `Workload.to_dict()`: the workload's fields, `modules` a list of module mappings in forward
order, each with its `params` (shapes as lists). Reading is strict, because a workload file is user input
(written by `fsdp-sim trace`, then maybe edited by hand): an unknown or missing key, a wrong type or a
negative size raises `ScenarioError` naming the file and the key path, e.g. `modules[3].saved_bytes`.
Required keys: the workload's `name` and `modules`, each module's `name` and `kind`, each parameter's
`name` and `shape`; every other key takes the default of its dataclass field.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import yaml

from fsdp_sim.dtypes import DTYPE_BYTES
from fsdp_sim.datafile import read_data, reject_unknown_keys
from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.workload.model import ATEN_OPS, KERNEL_KINDS, Kernel, Module, Param, Workload

# key -> kind of value: "str", "int" (non-negative), "float" (finite, non-negative), "bool", "dtype",
# "shape", "names" (list of str), "time" (float or null), "mapping"; plus the nested lists.
_WORKLOAD_KEYS = {"name": "str", "modules": "modules", "activation_dtype": "dtype", "input_bytes": "int",
                  "tokens": "int", "model_flops": "float", "meta": "mapping"}
_MODULE_KEYS = {"name": "str", "kind": "str", "params": "params", "tied_params": "names", "fwd_flops": "float",
                "bwd_flops": "float", "fwd_hbm_bytes": "float", "saved_bytes": "int", "fwd_temp_bytes": "int",
                "bwd_temp_bytes": "int", "bwd_temp_parts": "int", "bwd_tail_bytes": "int", "nosave_fwd_peak_bytes": "int", "output_bytes": "int", "saves_input": "bool", "is_block": "bool",
                "in_model": "bool", "records_graph": "bool", "fwd_time_s": "time", "bwd_time_s": "time",
                "kernels": "kernels"}
_PARAM_KEYS = {"name": "str", "shape": "shape", "dtype": "dtype", "trainable": "bool"}
_KERNEL_KEYS = {"name": "str", "kind": "kernel_kind", "shape": "shape", "bytes": "float", "bwd_bytes": "float",
                "launches": "int", "bwd_launches": "int", "causal": "bool", "recompute": "bool",
                "input_grad": "bool", "weight_grad": "bool", "aten_op": "aten_op", "output_saved": "bool",
                "dtype": "kernel_dtype"}
# limits that keep every sum exact and finite (the scenario's size check states the tighter ones)
MAX_NAME, MAX_INT, MAX_DIM, MAX_FLOAT, MAX_TIME_S = 1000, 1 << 56, 1 << 48, 1e30, 1e6
MAX_MODULES = 5000  # the scenario's MAX_MODULE_PASSES at one micro-batch
# the fields without a default: Workload name, modules; Module name, kind; Param name, shape
_REQUIRED = {cls: tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
             for cls in (Workload, Module, Param, Kernel)}

for _cls, _keys in ((Workload, _WORKLOAD_KEYS), (Module, _MODULE_KEYS), (Param, _PARAM_KEYS), (Kernel, _KERNEL_KEYS)):
    # the schema must follow the dataclasses: a field added there and not here would be silently dropped
    if {f.name for f in fields(_cls)} != set(_keys):  # pragma: no cover - a developer error, caught by any test
        raise RuntimeError(f"fsdp_sim.workload.io: the schema of {_cls.__name__} is out of date")


class _FlowMap(dict):
    """A mapping written on one line (a parameter), so a file of thousands of parameters stays readable."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_FlowMap, lambda d, m: d.represent_mapping("tag:yaml.org,2002:map", m, flow_style=True))


def workload_to_text(workload: Workload, *, as_json: bool = False) -> str:
    """The workload file's text: YAML (one line per parameter), or JSON."""
    data = workload.to_dict()
    if as_json:
        return json.dumps(data, indent=1) + "\n"
    for m in data["modules"]:
        m["params"] = [_FlowMap(p) for p in m["params"]]
        m["kernels"] = [_FlowMap(k) for k in m["kernels"]]
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=160)


def save_workload(workload: Workload, path: str | Path) -> None:
    """Write `workload` to `path`: JSON when the name ends in `.json`, YAML otherwise."""
    path = Path(path)
    try:
        path.write_text(workload_to_text(workload, as_json=path.suffix.lower() == ".json"))
    except OSError as exc:
        raise ScenarioError(f"cannot write workload {path}: {exc.strerror}") from None


def load_workload(path: str | Path) -> Workload:
    """Read and check a workload file written by `save_workload` (or by hand)."""
    data = read_data(path, "model.workload")
    try:
        return workload_from_dict(data)
    except ScenarioError as exc:
        raise ScenarioError(f"workload {path}: {exc}") from None


def workload_from_dict(data: Any) -> Workload:
    """Check the mapping of a workload file and build the `Workload`; errors name the key path."""
    kw = _fields(Workload, _WORKLOAD_KEYS, data, "")
    workload = Workload(**kw)
    _check_names(workload)
    return workload


def _fields(cls: type, schema: dict[str, str], data: Any, where: str) -> dict:
    if not isinstance(data, dict):
        raise ScenarioError(f"{where or 'workload'}: expected a mapping, got {type(data).__name__}")
    reject_unknown_keys(where, data, schema)
    prefix = f"{where}." if where else ""
    for key in _REQUIRED[cls]:
        if key not in data:
            raise ScenarioError(f"{prefix}{key}: missing (required)")
    return {key: _value(schema[key], data[key], f"{prefix}{key}") for key in data}


def _value(kind: str, value: Any, where: str) -> Any:
    if kind == "modules":
        if not isinstance(value, list) or not value:
            raise ScenarioError(f"{where}: expected a non-empty list of modules")
        if len(value) > MAX_MODULES:  # before building any: a step of more would take minutes to simulate
            raise ScenarioError(f"{where}: {len(value):,} modules, past the limit of {MAX_MODULES:,}")
        return tuple(Module(**_fields(Module, _MODULE_KEYS, m, f"{where}[{i}]")) for i, m in enumerate(value))
    if kind == "params":
        if not isinstance(value, list):
            raise ScenarioError(f"{where}: expected a list of parameters, got {type(value).__name__}")
        return tuple(Param(**_fields(Param, _PARAM_KEYS, p, f"{where}[{i}]")) for i, p in enumerate(value))
    if kind == "kernels":
        if not isinstance(value, list):
            raise ScenarioError(f"{where}: expected a list of kernels, got {type(value).__name__}")
        kernels = tuple(Kernel(**_fields(Kernel, _KERNEL_KEYS, k, f"{where}[{i}]")) for i, k in enumerate(value))
        for i, k in enumerate(kernels):
            wanted = {"gemm": 3, "attention": 4, "attention_eager": 4}.get(k.kind, 2)
            if len(k.shape) != wanted and (wanted != 2 or k.shape):
                raise ScenarioError(f"{where}[{i}].shape: a {k.kind} kernel needs {wanted} dimensions, got {show(list(k.shape))}")
            if wanted > 2 and not all(k.shape):
                raise ScenarioError(f"{where}[{i}].shape: a {k.kind} kernel's dimensions must be positive, got {list(k.shape)}")
        return kernels
    if kind == "kernel_kind":
        if not isinstance(value, str) or value not in KERNEL_KINDS:
            raise ScenarioError(f"{where}: unknown kernel kind {show(value)}, expected one of {list(KERNEL_KINDS)}")
        return value
    if kind == "kernel_dtype":  # a GEMM in another dtype than the compute dtype: "" (none) or fp8 (float8.py)
        if value not in ("", "fp8"):
            raise ScenarioError(f"{where}: {show(value)} is not one of ['', 'fp8']")
        return value
    if kind == "aten_op":
        if value not in ATEN_OPS:
            raise ScenarioError(f"{where}: {show(value)} is not one of {list(ATEN_OPS)}")
        return value
    if kind == "str":
        if not isinstance(value, str) or not value or not value.isprintable() or len(value) > MAX_NAME:
            raise ScenarioError(f"{where}: expected a non-empty printable string of at most {MAX_NAME} characters, "
                                f"got {show(value)}")
        return value
    if kind in ("dtype", "kernel_kind") and not isinstance(value, str):
        raise ScenarioError(f"{where}: expected a string, got {show(value)}")
    if kind == "dtype":
        if value not in DTYPE_BYTES:
            raise ScenarioError(f"{where}: unknown dtype {show(value)}, expected one of {sorted(DTYPE_BYTES)}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ScenarioError(f"{where}: expected true or false, got {show(value)}")
        return value
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 2.0 is 2: never a float in a byte count
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ScenarioError(f"{where}: expected a non-negative integer, got {show(value)}")
        if value > MAX_INT:
            raise ScenarioError(f"{where}: {show(value)} is past the limit of {MAX_INT:,}")
        return value
    if kind in ("float", "time"):
        if value is None and kind == "time":
            return None
        limit = MAX_TIME_S if kind == "time" else MAX_FLOAT
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= limit:
            raise ScenarioError(f"{where}: expected a finite non-negative number of at most {limit:g}, "
                                f"got {show(value)}")
        return float(value)
    if kind == "shape":
        if not isinstance(value, list) or len(value) > 16 or \
                any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_DIM for n in value):
            raise ScenarioError(f"{where}: expected a list of at most 16 integers in [0, {MAX_DIM:,}], got {show(value)}")
        return tuple(value)
    if kind == "names":
        if not isinstance(value, list) or any(not isinstance(n, str) for n in value):
            raise ScenarioError(f"{where}: expected a list of parameter names, got {show(value)}")
        return tuple(value)
    if kind == "mapping":
        if not isinstance(value, dict):
            raise ScenarioError(f"{where}: expected a mapping, got {type(value).__name__}")
        return value
    raise AssertionError(kind)  # pragma: no cover


def _check_names(workload: Workload) -> None:
    """Module and parameter names are unique; a tied parameter belongs to an earlier module."""
    modules: set[str] = set()
    params: set[str] = set()
    for i, m in enumerate(workload.modules):
        if m.name in modules:
            raise ScenarioError(f"modules[{i}].name: {show(m.name)} is used by an earlier module")
        modules.add(m.name)
        for name in m.tied_params:
            if name not in params:
                raise ScenarioError(f"modules[{i}].tied_params: {show(name)} is not a parameter of an earlier module")
        for j, p in enumerate(m.params):
            if p.name in params:
                raise ScenarioError(f"modules[{i}].params[{j}].name: {show(p.name)} is used by an earlier parameter")
            params.add(p.name)
    if not any(m.in_model for m in workload.modules):
        raise ScenarioError("modules: no module has in_model: true (the FSDP root would own nothing)")
