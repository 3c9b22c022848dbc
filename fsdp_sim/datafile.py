"""Reading the data files a user hands over (scenarios, profiles, workloads, configs, traces).

One place turns a missing file or unparsable text into the one-line `ScenarioError` that names the
scenario key that pointed at it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fsdp_sim.errors import ScenarioError

_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's safe loader when PyYAML has it


def reject_unknown_keys(where: str, data: dict, allowed) -> None:
    """The first key of `data` not in `allowed`, as `<where>.<key>: unknown key, ...`."""
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in allowed:
            raise ScenarioError(f"{prefix}{key}: unknown key, expected one of {sorted(allowed)}")


def read_data(path: str | Path, key: str, *, fmt: str = "yaml") -> Any:
    """The parsed content of a YAML (a superset of JSON) or JSON file; `key` names it in errors."""
    path = Path(path)
    if not path.is_file():
        raise ScenarioError(f"{key}: file not found: {path}")
    try:
        text = path.read_text()
        return json.loads(text) if fmt == "json" else yaml.load(text, Loader=_SAFE_LOADER)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{key}: {path} is not valid JSON ({exc})") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{key}: {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
