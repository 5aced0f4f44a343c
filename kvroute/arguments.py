"""argparse types that check their range: a bad value is argparse's clear message and exit 2, not a
traceback (or a command that runs doing nothing) further on."""

from __future__ import annotations

import argparse
import math

MAX_PORT = 65535


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:  # nan fails it too
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-{MAX_PORT})")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers, at least one."""
    return tuple(positive_int(part.strip()) for part in text.split(","))


def parse_pd(text: str) -> tuple[int, int]:
    """P:D, a disaggregated fleet's prefill and decode instances."""
    prefill, colon, decode = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"{text!r} is not P:D, prefill and decode instances (2:2)")
    return positive_int(prefill), positive_int(decode)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
