"""`fxacct profile`: the account of one training step, as tables, JSON, CSV or Markdown."""

from __future__ import annotations

import json

import click

import fxacct
from fxacct.report import document, render_rows, render_text
from fxacct_cli.main import FORMATS, cli, write_output
from fxacct_cli.options import model_options, to_config


@cli.command("profile")
@model_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("--by", type=click.Choice(("node", "module")), default="node", show_default=True,
              help="Rows of the csv/markdown table.")
@click.option("--depth", type=click.IntRange(min=0), default=2, show_default=True,
              help="Module nesting depth shown in the table.")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
              help="How many nodes, by FLOPs, the table lists.")
@click.option("-o", "--output", default=None, metavar="FILE", help="Write to FILE (atomically) instead of stdout.")
@click.option("--plot", default=None, metavar="FILE.png", help="Draw the memory timeline of the step (needs matplotlib).")
def profile_command(fmt, by, depth, top, output, plot, **options):
    """Profile PATH.py:NAME (an nn.Module class or factory) on fake tensors.

    \b
    Examples:
      fxacct profile examples/gpt2.py:GPT --batch 8 --dtype bf16
      fxacct profile examples/gpt2.py:GPT --batch 8 --amp bf16 --gpu h100 --world-size 8 --shard zero3
      fxacct profile model.py:make_model --input 'long[B,1024]<50257' --format json -o profile.json

    Exit codes: 0 success, 2 usage error, 3 the model failed.
    """
    config = to_config(**options)
    if plot is not None:
        from fxacct.report.plot import require_matplotlib

        require_matplotlib()
    result = fxacct.profile(config)
    if plot is not None:
        from fxacct.report.plot import plot_memory

        plot_memory(result, plot)
        click.echo(f"wrote {plot}", err=True)
    if fmt == "json":
        text = json.dumps(document(result), indent=2) + "\n"
    elif fmt in ("csv", "markdown"):
        text = render_rows(result, fmt, by)
    else:
        text = render_text(result, depth=depth, top=top)
    write_output(text, output)
