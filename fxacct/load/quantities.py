"""Numbers a flag carries, parsed exactly: counts ("70e9", "7B"), percentages ("5%"), durations
("250ms"), and the model-FLOPs utilization. Each parser raises a UsageError naming the flag and
the accepted form. Byte sizes are fxacct.units.parse_bytes.
"""

from __future__ import annotations

import re
from fractions import Fraction

from fxacct.errors import UsageError

_NUMBER = r"([+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)"

# SI count suffixes as model cards use them ("7B" parameters): k = 1e3, M = 1e6, B = G = 1e9, T = 1e12.
COUNT_SUFFIXES = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# The largest number a flag takes. The estimates multiply and divide up to three such numbers as
# floats (FLOPs = 6 · params · tokens, then seconds at FLOP/s): 1e30³ = 1e90 stays inside a
# double's range (IEEE 754: about 1.8e308), where 1e400 overflowed (an internal error). No real
# figure comes near: the largest training runs are of order 1e26 FLOPs.
LARGEST = 10**30


def _bounded(value: Fraction, text: str, flag: str) -> Fraction:
    if abs(value) > LARGEST:
        raise UsageError(f"{flag} {text!r} is too large: give a number up to 1e30")
    return value


# Durations: a bare number is seconds.
SECONDS = {"": 1, "s": 1, "ms": Fraction(1, 10**3), "us": Fraction(1, 10**6), "µs": Fraction(1, 10**6),
           "min": 60, "h": 3600}


def parse_count(text: str, flag: str) -> int:
    """'70e9', '15e12', '7B', '125M' -> an exact positive integer."""
    if text is None:  # a required flag not given ("None is not a count" named no fix)
        raise UsageError(f"{flag} is missing: give a whole number such as 70e9, 15e12 or 7B")
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([A-Za-z]?)\s*", str(text))
    if m is not None and m.group(2).upper() in COUNT_SUFFIXES and m.group(2) not in COUNT_SUFFIXES:
        m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([A-Za-z]?)\s*", str(text).upper())  # 7b reads as 7B
    if m is None or m.group(2) not in COUNT_SUFFIXES:
        raise UsageError(f"{flag} {text!r} is not a count: write a whole number such as 70e9, 15e12 or 7B")
    value = _bounded(Fraction(m.group(1)) * COUNT_SUFFIXES[m.group(2)], text, flag)
    if value <= 0:
        raise UsageError(f"{flag} must be positive, got {text}")
    if value.denominator != 1:
        raise UsageError(f"{flag} {text!r} is not a whole number: give an integer count such as 70e9")
    return int(value)


def parse_percent(text: str, flag: str) -> Fraction:
    """'5%' or '5' -> Fraction(5) (percent); at least 0."""
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*%?\s*", str(text))
    if m is None:
        raise UsageError(f"{flag} {text!r} is not a percentage: write e.g. 5% or 0.5%")
    value = _bounded(Fraction(m.group(1)), text, flag)
    if value < 0:
        raise UsageError(f"{flag} {text!r} is negative: give the largest allowed increase, 0% or more")
    return value


def parse_duration(text: str, flag: str) -> Fraction:
    """'250ms', '1.5s', '2' (seconds), '10min', '1h' -> seconds, exact; positive."""
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([a-zµ]*)\s*", str(text))
    if m is None or m.group(2) not in SECONDS:
        raise UsageError(f"{flag} {text!r} is not a duration: write e.g. 250ms, 1.5s, 10min or 1h")
    value = _bounded(Fraction(m.group(1)) * SECONDS[m.group(2)], text, flag)
    if value <= 0:
        raise UsageError(f"{flag} must be positive, got {text}")
    return value


# An assumption, not a measurement: the middle of the seeds' "0.3 to 0.5 is good" MFU range.
DEFAULT_MFU = 0.4


def check_mfu(mfu: float) -> float:
    """Model FLOPs utilization: achieved / peak FLOP/s, in (0, 1]."""
    if not 0 < mfu <= 1:
        raise UsageError(f"--mfu {mfu:g} is outside (0, 1]: it is achieved / peak FLOP/s, e.g. 0.3 to 0.5")
    return mfu
