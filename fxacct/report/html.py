"""The HTML report: one self-contained page, readable offline and shareable as a single file.

The page carries the profile document (fxacct.report.document, schema fxacct.profile/1) plus the
memory timeline of the step as one embedded JSON; the script in assets/report.js draws it (summary
cards, module treemaps, timeline, node table, predicted beside measured). The summary and the totals
are also in the page as static HTML (static_summary), readable without JavaScript. Nothing is fetched when the page
is viewed: the template, style and script are inlined here, and a Content-Security-Policy forbids
any request.
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources

from fxacct.errors import InternalError
from fxacct.memory.peak import CATEGORIES
from fxacct.report.document import document
from fxacct.report.markdown import totals_rows
from fxacct.report.plot import memory_timeline
from fxacct.report.summary_text import facts

_ASSETS = ("report.html", "report.css", "report.js")
_MARKERS = re.compile(r"\{\{TITLE\}\}|/\*\{\{CSS\}\}\*/|/\*\{\{JS\}\}\*/|\{\{DATA\}\}|\{\{STATIC\}\}")


def timeline_json(profile) -> dict:
    """The memory timeline of fxacct.report.plot (live bytes by category after each op, one rank),
    with each op's module, as parallel lists; ``peak`` is its first highest point, the op at which
    ``memory.peak_train`` (``per_rank`` when sharded) is reached."""
    items = memory_timeline(profile)
    module_of = {n.name: cost.module for n in profile.capture.graph.nodes
                 if (cost := n.meta.get("fxacct")) is not None}
    categories = [c for c in CATEGORIES if any(live[c] for _, _, live in items)]
    totals = [sum(live.values()) for _, _, live in items]
    peak = max(range(len(items)), key=totals.__getitem__, default=None)
    return {
        "categories": categories,
        "names": [name for name, _, _ in items],
        "phases": [phase for _, phase, _ in items],
        "modules": [module_of.get(name, "") for name, _, _ in items],
        "bytes": [[live[c] for c in categories] for _, _, live in items],
        "peak": None if peak is None else {"index": peak, "node": items[peak][0], "phase": items[peak][1],
                                           "bytes": totals[peak]},
    }


def html_document(profile, prediction=None, runtime=None) -> dict:
    """The data the page renders: the JSON document with the timeline added under ``timeline``."""
    doc = document(profile, prediction, runtime)
    doc["timeline"] = timeline_json(profile)
    return doc


def _script_json(data: dict) -> str:
    """JSON safe inside <script>: '<', '>' and '&' only occur in strings, where \\u escapes mean
    the same characters, so no '</script>' or '<!--' can end the element early."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def static_summary(profile, prediction=None) -> str:
    """The summary (fxacct.report.summary_text.facts) and the totals (the markdown report's rows) as
    plain HTML, so the page shows its numbers without JavaScript; the script adds the cards and charts."""
    esc = html.escape
    items = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in facts(profile, prediction))
    rows = "".join(f'<tr><th scope="row">{esc(k)}</th><td class="num">{esc(v)}</td></tr>'
                   for k, v in totals_rows(profile, prediction))
    return (f'<dl id="summary-facts" class="facts">{items}</dl>\n'
            f'<table id="totals" class="data totals"><caption>Totals</caption>'
            f'<thead><tr><th scope="col">total</th><th scope="col" class="num">value</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>")


def _asset(name: str) -> str:
    return resources.files("fxacct.report").joinpath("assets", name).read_text(encoding="utf-8")


def render_html(profile, prediction=None, runtime=None) -> str:
    """The whole page as one string: template, style, script and data inlined (one pass over the
    template, so nothing inserted is searched for markers again)."""
    template, css, js = (_asset(name) for name in _ASSETS)
    title = f"fxacct profile: {profile.title}"
    parts = {"{{TITLE}}": html.escape(title), "/*{{CSS}}*/": css, "/*{{JS}}*/": js,
             "{{DATA}}": _script_json(html_document(profile, prediction, runtime)),
             "{{STATIC}}": static_summary(profile, prediction)}
    missing = [m for m in parts if m not in template]
    if missing:
        raise InternalError(f"fxacct/report/assets/report.html lacks {', '.join(missing)}")
    return _MARKERS.sub(lambda m: parts[m.group(0)], template)


__all__ = ["render_html", "html_document", "timeline_json", "static_summary"]
