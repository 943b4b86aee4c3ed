"""`fxacct diff`: two profile JSON files compared, with --max-increase budgets that set the exit
code (0 all hold, 1 one is over, 2 usage error)."""

from __future__ import annotations

import json
import sys

import click

from fxacct.load.profile_file import read_profile, same_schema
from fxacct.tools.diff import diff
from fxacct_cli.main import cli, examples, write_output
from fxacct_cli.options import DEBUG, OUTPUT, OUTPUT_GROUP, format_option, group


@cli.command("diff", epilog=examples(
    "fxacct diff baseline.json new.json",
    "fxacct diff baseline.json new.json --max-increase flops=5% --max-increase peak_train_bytes=2%",
    "fxacct diff baseline.json new.json --max-increase flops=5% --format markdown -o comment.md"))
@click.argument("old", metavar="BASELINE.json")
@click.argument("new", metavar="NEW.json")
@group("Budgets", click.option(
    "--max-increase", "max_increase", multiple=True, metavar="KEY=PCT",
    help="Fail when totals KEY grows by more than PCT percent (flops=5%, peak_train_bytes=2%). "
         "KEY: any totals key (dotted for nested ones), or flops = forward + backward. Repeatable (default: none)."))
@group(OUTPUT_GROUP,
       click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
                    help="How many changed modules to list."),
       format_option("table", "json", "markdown"), OUTPUT, DEBUG)
def diff_command(old, new, max_increase, top, fmt, output, debug):
    """Compare two `fxacct profile --format json` files of the same schema version; --format markdown
    gives the verdict and change tables for a pull-request comment.

    \b
    Exit codes: 0 every budget holds; 1 a budget is over; 2 usage error (a missing or malformed
    file, different schema versions); 4 an internal error of fxacct.
    """
    a, b = read_profile(old), read_profile(new)
    same_schema(a, b, old, new)
    result = diff(a, b, max_increase, top)
    # the report modules come in with torch (fxacct.report): after every usage error has answered
    from fxacct.report.diff_markdown import render_diff_markdown
    from fxacct.report.diff_text import diff_document, render_diff

    if fmt == "json":
        text = json.dumps(diff_document(result, old, new), indent=2) + "\n"
    elif fmt == "markdown":
        text = render_diff_markdown(result, old, new)
    else:
        text = render_diff(result, old, new)
    write_output(text, output)
    if not result.ok:
        sys.exit(1)  # a budget is over (DESIGN.md exit codes); click's ctx.exit would be swallowed
