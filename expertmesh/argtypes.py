"""argparse types that refuse out-of-range numbers with the flag's own name in the error."""
from __future__ import annotations

import argparse


def _number(kind, low, strict: bool, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
        if value != value or (value <= low if strict else value < low):   # NaN or out of range
            raise argparse.ArgumentTypeError(f"expected {what}, found {text}")
        return value
    return parse


positive_int = _number(int, 0, True, "an integer > 0")
nonnegative_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0.0, True, "a number > 0")
nonnegative_float = _number(float, 0.0, False, "a number >= 0")
