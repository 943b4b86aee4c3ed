"""Units and counting conventions, declared once for the whole package.

- One multiply-add (FMA) is 2 FLOPs: a matmul (m×n)@(n×p) costs 2·m·n·p FLOPs.
  fvcore, thop and ptflops count MACs (1 FMA = 1); multiply their figures by 2 to compare.
- Bytes are numel × element size, exact integers.
- GB = 10**9 bytes (vendors' "80 GB"); GiB = 2**30 bytes (what drivers and allocators report).
  The two are never mixed: every figure says which one it is in.
"""

FLOPS_PER_FMA = 2
GB = 10**9
GiB = 2**30


def format_bytes(n: int | None) -> str:
    """Human-readable bytes in binary units (KiB up to EiB, the unit picked by magnitude), the exact
    integer below 1 KiB."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n} B"
    for unit, size in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    raise AssertionError("unreachable")


def format_count(n: int | float | None) -> str:
    """A FLOP or parameter count with an SI suffix (k = 1e3, M = 1e6, G = 1e9, T = 1e12, P = 1e15)."""
    if n is None:
        return "-"
    if abs(n) < 1000 and (isinstance(n, int) or abs(float(f"{n:.3g}")) < 1000):  # 999.96 reads 1.000k
        return f"{n:,}" if isinstance(n, int) else f"{n:.3g}"
    if abs(n) >= 999.9995e18:  # past E (a zetta-count): in powers of ten
        return f"{n:.3e}"
    units = (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))
    for i, (unit, size) in enumerate(units):
        if abs(n) >= size or unit == "k":
            if i and abs(round(n / size, 3)) >= 1000:  # 999.9996T reads 1.000P, not 1000.000T
                unit, size = units[i - 1]
            return f"{n / size:.3f}{unit}"
    raise AssertionError("unreachable")


# Byte units a flag may carry ("80GB", "79.6GiB", "512MiB"): decimal SI (vendors) and binary IEC
# (drivers, allocators), per IEC 80000-13. A bare number is refused (parse_bytes: bytes? GB?).
BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' -> 80_000_000_000, '79.6GiB' -> 85_469_849_190 (exact, rounded down to a whole byte);
    a ValueError naming the accepted units otherwise."""
    import re
    from fractions import Fraction

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    if m is None or not unit or unit not in BYTE_UNITS:  # a bare number is ambiguous: bytes? GB?
        raise ValueError(f"{text!r} is not a byte size: write a number with a unit such as 80GB, 79.6GiB, "
                         "512MiB or 1KB (GB = 1e9 B, GiB = 2^30 B)")
    return int(Fraction(m.group(1)) * BYTE_UNITS[unit or "B"])
