"""argparse value types shared by the `mlaserve` subcommands (a bad value exits 2 naming the flag)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_int(text: str) -> int:
    """argparse type of a count that must be > 0 (a bad one exits 2 naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def float_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """argparse type of a number in [low, high] (either end open with `low_open`, `high_open`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not (value < high if high_open else value <= high):
            raise argparse.ArgumentTypeError(f"{text!r} must be in {'(' if low_open else '['}{low:g}, {high:g}"
                                             f"{')' if high_open else ']'}")
        return value

    return parse
