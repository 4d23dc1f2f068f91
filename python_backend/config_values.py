"""Reading the models' config.pbtxt parameter values (strings) into typed values, with errors that name them."""

from __future__ import annotations


def flag(value: str, name: str) -> bool:
    """"true"/"1"/"yes" or "false"/"0"/"no"/"" (any case); anything else is an error naming the parameter."""
    if value.strip().lower() in ("", "false", "0", "no"):
        return False
    if value.strip().lower() in ("true", "1", "yes"):
        return True
    raise ValueError(f"{name} must be true or false, not {value!r}")
