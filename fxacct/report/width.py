"""Fitting the human report to a width (the terminal's, chosen by the CLI): text columns such as
module paths are shortened in the middle with "…", numbers are never cut; when shortening is not
enough, the least important columns are left out (the caller names them); prose lines are wrapped.
``width=None`` means no limit (--wide, or output that is not a terminal)."""

from __future__ import annotations

import textwrap

from fxacct.report.tables import tabulate

ELLIPSIS = "…"
SOFT_TEXT = 20  # text columns are shortened to this before any column is left out
MIN_TEXT = 12  # a text column is never shortened below this many characters


def shorten_middle(text: str, width: int) -> str:
    """'transformer.h.11.mlp.c_proj' at 16 -> 'transfor…c_proj': both ends kept, the middle cut."""
    if len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    head = width // 2
    tail = width - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def _width_of(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def _render(headers, rows, keep, caps, colalign) -> str:
    hs = [headers[i] for i in keep]
    body = [[shorten_middle(str(r[i]), caps[i]) if i in caps else r[i] for i in keep] for r in rows]
    return tabulate(body, headers=hs, colalign=tuple(colalign[i] for i in keep))


def _shrink(headers, rows, keep, text_columns, colalign, width: int, floor: int):
    """(table, fits): the text columns among ``keep`` shortened, widest first, down to ``floor``."""
    caps: dict[int, int] = {}
    text = _render(headers, rows, keep, caps, colalign)
    while _width_of(text) > width:
        lengths = {i: min(caps.get(i, 10**9), max([len(str(r[i])) for r in rows] + [len(headers[i])]))
                   for i in text_columns if i in keep}
        widest = max((i for i, n in lengths.items() if n > floor), key=lengths.get, default=None)
        if widest is None:
            return text, False
        caps[widest] = max(floor, lengths[widest] - (_width_of(text) - width))
        text = _render(headers, rows, keep, caps, colalign)
    return text, True


def fit_table(headers, rows, width: int | None, text_columns=(), optional=(), colalign=None) -> str:
    """A tabulate table no wider than ``width``: the ``text_columns`` (indices) are shortened in the
    middle (to SOFT_TEXT at most), then the ``optional`` columns are left out in the order given, then
    the text columns are shortened down to MIN_TEXT. Number columns are never cut."""
    colalign = tuple(colalign or (("left",) + ("right",) * (len(headers) - 1)))
    keep = list(range(len(headers)))
    if width is None:
        return _render(headers, rows, keep, {}, colalign)
    for dropped in range(len(optional) + 1):
        keep = [i for i in range(len(headers)) if i not in optional[:dropped]]
        text, fits = _shrink(headers, rows, keep, text_columns, colalign, width, SOFT_TEXT)
        if fits:
            return text
    return _shrink(headers, rows, keep, text_columns, colalign, width, MIN_TEXT)[0]


def wrap_lines(text: str, width: int | None) -> str:
    """Every line longer than ``width`` wrapped at spaces, continuation lines indented by two more
    spaces than the line's own indent (tables already fit, so only prose is wrapped)."""
    if width is None:
        return text
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip(" ")))
        out += textwrap.wrap(line, width=width, initial_indent="", subsequent_indent=indent + "  ",
                             break_long_words=True, break_on_hyphens=False, drop_whitespace=True) or [""]
    return "\n".join(out)


__all__ = ["shorten_middle", "fit_table", "wrap_lines", "ELLIPSIS"]
