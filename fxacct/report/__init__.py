"""Rendering: the only place that formats numbers. Text tables (tabulate), JSON, CSV, Markdown."""

from fxacct.report.document import document  # noqa: F401
from fxacct.report.text import render_text  # noqa: F401
from fxacct.report.rows import render_rows  # noqa: F401
