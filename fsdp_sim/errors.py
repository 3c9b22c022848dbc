"""The one error type for bad user input.

Everything a user can get wrong (a scenario key, a value, a file, a preset name) raises `ScenarioError`
with a one-line message naming the offending key or value and what was expected. The CLI turns it into
that line on stderr and exit code 2; no other layer prints or exits.
"""


class ScenarioError(ValueError):
    """Bad user input, described in one line."""
