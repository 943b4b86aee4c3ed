"""Rendering: the only place that formats numbers. Text tables (tabulate), JSON, CSV, Markdown, HTML.

``render(profile, format)`` is the one way to a whole report, for Python and the CLI alike."""

from fxacct.report.document import document  # noqa: F401
from fxacct.report.render import render  # noqa: F401
from fxacct.report.rows import render_rows  # noqa: F401
from fxacct.report.text import render_text  # noqa: F401
