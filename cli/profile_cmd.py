"""`fxacct profile`: the account of one training step, as tables, JSON, CSV or Markdown."""

from __future__ import annotations

import json
import sys

import click

import fxacct
from fxacct.errors import UsageError
import fxacct.predict.roofline
from fxacct.report import document, render_rows
from fxacct.report.text import render_profile_text
from fxacct_cli.main import FORMATS, cli, write_output
from fxacct_cli.options import model_options, to_config


def _check_layout_flags(fmt: str, by, depth, top) -> None:
    """--by picks csv/markdown rows; --depth and --top shape the table: elsewhere they would do
    nothing, so they are refused rather than ignored."""
    if by is not None and fmt not in ("csv", "markdown"):
        raise UsageError(f"--by chooses the rows of --format csv or markdown; the {fmt} output has "
                         "both modules and nodes: drop --by or add --format csv")
    for flag, value in (("--depth", depth), ("--top", top)):
        if value is not None and fmt != "table":
            raise UsageError(f"{flag} shapes the text table; --format {fmt} writes every "
                             f"{'module' if flag == '--depth' else 'node'}: drop {flag}")


@cli.command("profile")
@model_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("--by", type=click.Choice(("node", "module")), default=None,
              help="Rows of the csv/markdown table.")
@click.option("--depth", type=click.IntRange(min=0), default=None,
              help="Module nesting depth shown in the table.")
@click.option("--top", type=click.IntRange(min=0), default=None,
              help="How many nodes, by FLOPs, the table lists.")
@click.option("-o", "--output", default=None, metavar="FILE", help="Write to FILE (atomically) instead of stdout.")
@click.option("--plot", default=None, metavar="FILE.png", help="Draw the memory timeline of the step (needs matplotlib).")
@click.option("--runtime", is_flag=True,
              help="Also run the real model under torch.profiler and compare measured with predicted.")
@click.option("--device", default=None, help="Where --runtime runs: auto (CUDA if present), cpu, cuda, cuda:N.")
@click.option("--steps", type=int, default=None, help="--runtime: timed steps (default 10).")
@click.option("--warmup", type=int, default=None, help="--runtime: warm-up steps before them (default 3).")
@click.option("--inference", is_flag=True, help="--runtime: time forward passes under eval() and no_grad().")
@click.option("--force", is_flag=True, help="--runtime: run even if the predicted peak exceeds free memory.")
@click.option("--trace", default=None, metavar="FILE.json",
              help="--runtime: write a Chrome/Perfetto trace, measured beside predicted.")
def profile_command(fmt, by, depth, top, output, plot, runtime, device, steps, warmup, inference, force, trace,
                    **options):
    """Profile PATH.py:NAME (an nn.Module class or factory) on fake tensors.

    \b
    Examples:
      fxacct profile examples/gpt2.py:GPT --batch 8 --dtype bf16
      fxacct profile examples/gpt2.py:GPT --batch 8 --amp bf16 --gpu h100 --world-size 8 --shard zero3
      fxacct profile model.py:make_model --input 'long[B,1024]<50257' --format json -o profile.json

    Exit codes: 0 success, 1 not enough free memory for --runtime, 2 usage error, 3 the model
    failed, 4 an internal error.
    """
    _check_layout_flags(fmt, by, depth, top)
    by, depth, top = by or "node", 2 if depth is None else depth, 10 if top is None else top
    config = to_config(**options)
    if plot is not None:
        from fxacct.report.plot import require_matplotlib

        require_matplotlib()
    run = None
    if runtime:
        run = _run_runtime(config, device, steps, warmup, inference, force, trace)
        result, prediction = run.profile, run.prediction
    else:
        given = [f for f, v in (("--device", device), ("--steps", steps), ("--warmup", warmup),
                                ("--inference", inference), ("--force", force), ("--trace", trace)) if v]
        if given:
            raise fxacct.UsageError(f"{', '.join(given)} take(s) effect with --runtime: add --runtime")
        result = fxacct.profile(config)
        prediction = fxacct.predict.roofline.predict_profile(result)
    if plot is not None:
        from fxacct.report.plot import plot_memory

        plot_memory(result, plot)
        click.echo(f"wrote {plot}", err=True)
    if fmt == "json":
        text = json.dumps(document(result, prediction, run), indent=2) + "\n"
    elif fmt in ("csv", "markdown"):
        text = render_rows(result, fmt, by)
    else:
        text = render_profile_text(result, depth=depth, top=top, prediction=prediction, runtime=run)
    write_output(text, output)
    if run is not None and trace is not None:
        from fxacct.report.trace import trace_document

        write_output(json.dumps(trace_document(run.measured.trace_events, run.prediction)) + "\n", trace)
    if run is not None and run.measured.interrupted:
        click.echo(f"error: interrupted after {run.measured.steps} of {run.measured.steps_requested} timed steps; "
                   "the report shows what was measured", err=True)
        sys.exit(130)


def _run_runtime(config, device, steps, warmup, inference, force, trace):
    """fxacct.runtime.run with a progress bar over warm-up and timed steps on stderr."""
    from fxacct.runtime import RuntimeOptions, run

    options = RuntimeOptions(device=device or "auto", steps=10 if steps is None else steps,
                             warmup=3 if warmup is None else warmup, inference=inference, force=force,
                             keep_trace=trace is not None)
    bar = None

    def progress(stage: str, done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = click.progressbar(length=total, label="runtime", file=sys.stderr)
            bar.__enter__()
        bar.label = stage
        bar.update(done - bar.pos)

    try:
        return run(config, options, progress)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
