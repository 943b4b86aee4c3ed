"""One way to turn a Profile into a report, for Python and for `fxacct profile --format` alike
(the CLI calls ``render``, so the two cannot drift).

    >>> import fxacct
    >>> from fxacct.report import render
    >>> p = fxacct.profile(fxacct.Config(target="examples/two_layer.py:TwoLayer", batch=2))
    >>> print(render(p, "markdown", summary_only=True).splitlines()[0])
    ### fxacct profile: `examples/two_layer.py:TwoLayer`
    >>> import json
    >>> json.loads(render(p, "json"))["totals"]["forward_flops"]  # 2·B·(D·H + H·K) = 2·2·(9 + 6)
    60
"""

from __future__ import annotations

import json

from fxacct.errors import UsageError
from fxacct.report.document import document
from fxacct.report.html import render_html
from fxacct.report.markdown import render_markdown
from fxacct.report.rows import render_rows
from fxacct.report.text import DEFAULT_DEPTH, DEFAULT_TOP, render_profile_text
from fxacct.step import Profile

FORMATS = ("text", "json", "csv", "markdown", "html")
ALIASES = {"table": "text"}  # the CLI's --format name of the text report
RUNTIME_FORMATS = ("text", "json", "html")  # the reports that show a --runtime run beside the account
PREDICT = object()  # render's default: the profile's own prediction (fxacct.api attaches it)


def render(profile: Profile, format: str = "text", prediction=PREDICT, runtime=None, *, by: str | None = None,
           depth: int | None = None, top: int | None = None, summary_only: bool = False,
           width: int | None = None) -> str:
    """The report of ``profile`` as one string, in ``format``: "text" (the CLI's table; "table" is
    the same), "json" (schema fxacct.profile/1), "csv", "markdown" or "html" (one self-contained page).

    ``prediction``: the predicted step time shown beside the account; by default the profile's own
    (``profile.prediction``: its --gpu, else a calibrated CPU), None for none. ``runtime``: a fxacct.runtime run to compare with (text, json, html). ``by``: the rows
    of csv ("node", the default) or markdown ("module", the default). ``depth``: the module nesting
    of text and markdown (default 2); ``top``: the nodes text lists (default 10); ``summary_only``:
    only the summary (text, markdown); ``width``: the width text fits (None: no limit)."""
    fmt = ALIASES.get(format, format)
    if fmt not in FORMATS:
        raise UsageError(f"unknown report format {format!r}: use one of {', '.join(FORMATS)}")
    _check_layout(fmt, by, depth, top, summary_only)
    if runtime is not None and fmt not in RUNTIME_FORMATS:
        raise UsageError(f"the {fmt} report carries no runtime figures ({', '.join(RUNTIME_FORMATS)} do): render "
                         "the run in one of those, or give no runtime")
    if prediction is PREDICT:
        prediction = profile.prediction
    depth = DEFAULT_DEPTH if depth is None else depth
    if fmt == "json":
        return json.dumps(document(profile, prediction, runtime), indent=2) + "\n"
    if fmt == "html":
        return render_html(profile, prediction, runtime)
    if fmt == "csv":
        return render_rows(profile, fmt, **({"by": by} if by is not None else {}))
    if fmt == "markdown":
        return render_markdown(profile, prediction, by=by or "module", depth=depth, summary_only=summary_only)

    return render_profile_text(profile, depth=depth, top=DEFAULT_TOP if top is None else top, prediction=prediction,
                               runtime=runtime, width=width, summary_only=summary_only)


def _check_layout(fmt: str, by, depth, top, summary_only: bool) -> None:
    """Layout options of the wrong kind, or for a format they do nothing to, are refused rather than
    ignored (as `fxacct profile` refuses its flags: --by, --depth, --top, --summary)."""
    if by not in (None, "node", "module"):
        raise UsageError(f"by={by!r}: give 'node' or 'module' (the rows of csv or markdown)")
    if by is not None and fmt not in ("csv", "markdown"):
        raise UsageError(f"by={by!r} chooses the rows of csv or markdown; the {fmt} report has both: drop by")
    for name, value in (("depth", depth), ("top", top)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise UsageError(f"{name}={value!r}: give a whole number, 0 or more")
        shaped = ("text", "markdown") if name == "depth" else ("text",)
        if value is not None and fmt not in shaped:
            raise UsageError(f"{name} shapes the {' and '.join(shaped)} report; the {fmt} report has every "
                             f"{'module' if name == 'depth' else 'node'}: drop {name}")
    if summary_only and fmt not in ("text", "markdown"):
        raise UsageError(f"summary_only shortens the text or markdown report; the {fmt} report is whole: drop it")


__all__ = ["render", "FORMATS", "RUNTIME_FORMATS"]
