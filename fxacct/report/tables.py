"""tabulate, as every report here calls it.

tabulate is imported on the first table, not with the report: it imports wcwidth where that is
installed, 0.18 s on a 2-core machine (python -X importtime), which a --format json or csv
answer never needs."""


def tabulate(rows, headers=(), **kwargs) -> str:
    """Cells arrive formatted ("1.08 MiB", "7,004,713,710,336"): tabulate must not re-parse some of
    them as floats (it would print a column half as 7.00471e+12). Columns after the first are
    right-aligned unless the caller says otherwise."""
    kwargs.setdefault("disable_numparse", True)
    if "colalign" not in kwargs and rows:
        width = max(len(r) for r in rows)
        kwargs["colalign"] = ("left",) + ("right",) * (width - 1)
    from tabulate import tabulate as _tabulate

    return _tabulate(rows, headers=headers, **kwargs)
