"""One way to print a duration everywhere: the unit is picked so the number is at least 1
(ns below 1 µs, µs below 1 ms, ms below 1 s, s above), 3 significant digits (a step of
44,100 ms reads 44.1 s; a loss of 0.00481 µs reads 4.81 ns)."""


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms == 0:
        return "0 s"
    for unit, scale, below in (("ns", 1e6, 1e-3), ("µs", 1e3, 1), ("ms", 1, 1000)):
        if abs(ms) < below:
            return f"{ms * scale:.3g} {unit}"
    return f"{ms / 1e3:.3g} s"
