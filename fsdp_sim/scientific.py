"""Numbers in e-notation where a scenario or profile wants a number.

PyYAML follows YAML 1.1, whose float needs a dot and a signed exponent: `1.0e+8` is a float there, while
`1e8`, `1.0e8` and `1e-5` stay strings. People write them as numbers, so a key that wants an integer or a
float takes them as one: an integer only when the value is exact (`1e8`, `2.5e3`; not `1.5e0`, and not a
value past 1000 digits, which no limit admits anyway).
"""

from __future__ import annotations

import re
from decimal import Decimal

SCIENTIFIC = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def from_scientific(value: object, kind: type) -> object:
    """`value` as `kind` (int or float) when it is e-notation text that `kind` holds exactly; else unchanged
    (so the caller's type check refuses it with the value as written)."""
    if kind not in (int, float) or not isinstance(value, str) or not SCIENTIFIC.fullmatch(value.strip()):
        return value
    number = Decimal(value.strip())
    if kind is float:
        return float(number)
    if number.adjusted() > 1000 or number != number.to_integral_value():
        return value
    return int(number)
