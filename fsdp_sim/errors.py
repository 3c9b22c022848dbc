"""The one error type for bad user input.

Everything a user can get wrong (a scenario key, a value, a file, a preset name) raises `ScenarioError`
with a one-line message naming the offending key or value and what was expected. The CLI turns it into
that line on stderr and exit code 2; no other layer prints or exits.

The message is made one line here, whatever went into it: characters that would break the line or not
print (newlines, other control characters, lone surrogates from undecodable file names) are written as
escapes, and a message longer than `MAX_MESSAGE` characters keeps its start (the key) and its end (what
was expected, or the value's end) around an ellipsis. `show` abbreviates a value for a message without
walking all of it.
"""

from __future__ import annotations

import reprlib
import warnings

MAX_MESSAGE = 280  # characters of one error line, `fsdp-sim: error: ` not included

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 2, 4, 4, 3, 4
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 48, 24, 48


def show(value, limit: int = 60) -> str:
    """`repr(value)`, abbreviated: a few elements of a list or mapping, two levels deep, long strings and
    numbers cut in the middle. Bounded work, however large or deeply nested the value is."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails still gets a name
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 21] + "..." + text[-18:]


def _escape(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """`message` as one printable line of at most `limit` characters (start and end kept)."""
    head, tail = limit * 2 // 3, limit - limit * 2 // 3 - 5
    if len(message) > 4 * limit:  # escaping can only lengthen: cut first, so a 10 MB message costs nothing
        message = message[: 2 * head] + message[-2 * tail:]
    text = _escape(message)
    if len(text) > limit:
        text = text[:head] + " ... " + text[-tail:]
    return text


class ScenarioError(ValueError):
    """Bad user input, described in one line (see the module docstring)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(one_line(str(message)), *args)


class ScenarioWarning(UserWarning):
    """Input that runs, but that a user should hear about: a field the model does not price, a value past
    what the model itself was made for. The CLI prints each as one line on stderr; the result stands."""


def warn(message: str) -> None:
    """Say `message` as a one-line ScenarioWarning (the CLI shows it as `fsdp-sim: warning: ...`)."""
    warnings.warn(ScenarioWarning(one_line(message)), stacklevel=2)
