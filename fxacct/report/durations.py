"""One way to print a duration everywhere: µs below 1 ms, ms below 1 s, s above, 3 significant
digits (a step of 44,100 ms reads 44.1 s)."""


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    if abs(ms) < 1:
        return f"{ms * 1e3:.3g} µs"
    if abs(ms) < 1000:
        return f"{ms:.3g} ms"
    return f"{ms / 1e3:.3g} s"
