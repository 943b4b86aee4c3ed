"""One way to print a duration everywhere: the unit is picked so the number is at least 1 and below
the next unit (ns below 1 µs, µs below 1 ms, ms below 1 s, s below 1 min, then min, h, days, months
of 30 days as `fxacct estimate train-time` counts them, years of 365 days), 3 significant digits
(a step of 44,100 ms reads 44.1 s; a loss of 0.00481 µs reads 4.81 ns; 0.0238 days reads 34.3 min)."""

from fxacct.tools.estimate import DAYS_PER_MONTH

_DAY = 86_400
# (unit, seconds in it, the seconds where the next unit takes over)
_UNITS = (("ns", 1e-9, 1e-6), ("µs", 1e-6, 1e-3), ("ms", 1e-3, 1), ("s", 1, 60), ("min", 60, 3600),
          ("h", 3600, _DAY), ("days", _DAY, DAYS_PER_MONTH * _DAY), ("months", DAYS_PER_MONTH * _DAY, 365 * _DAY),
          ("years", 365 * _DAY, float("inf")))


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s == 0:
        return "0 s"
    for unit, size, below in _UNITS:
        shown = float(f"{s / size:.3g}")  # 999.9 µs rounds to 1000: the next unit's 1 (it read "1e+03 µs")
        if abs(shown * size) < below * (1 - 1e-12):
            return f"{shown:g} {unit}"
    raise AssertionError("unreachable")


def format_ms(ms: float | None) -> str:
    return format_seconds(None if ms is None else ms / 1e3)


__all__ = ["format_ms", "format_seconds"]
