"""`fxacct profile`: the account of one training step, as tables, JSON, CSV or Markdown."""

from __future__ import annotations

import inspect
import json
import sys

import click

import fxacct
from fxacct.errors import UsageError
from fxacct.predict.roofline import predict_profile
from fxacct.report import document, render_rows
from fxacct.report.text import render_profile_text
from fxacct.runtime import RuntimeOptions
from fxacct_cli.main import cli, write_output
from fxacct_cli.options import FORMATS, OUTPUT, file_option, format_option, mesh_options, model_options, to_config, with_mesh


def _default(fn, name: str):
    return inspect.signature(fn).parameters[name].default


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


def _runtime_options(runtime: bool, trace, **given) -> RuntimeOptions | None:
    """The RuntimeOptions of the flags given (the library's defaults for the rest), or None
    without --runtime, where any of them is refused rather than ignored."""
    given = {k: v for k, v in given.items() if v is not None and v is not False}
    if not runtime:
        flags = [f"--{k}" for k in given] + (["--trace"] if trace is not None else [])
        if flags:
            raise UsageError(f"{', '.join(flags)} take(s) effect with --runtime: add --runtime")
        return None
    return RuntimeOptions(**given, keep_trace=trace is not None)


@cli.command("profile")
@model_options
@mesh_options
@format_option(*FORMATS)
@click.option("--by", type=click.Choice(("node", "module")), default=None,
              help=f"Rows of the csv/markdown table (default {_default(render_rows, 'by')}).")
@click.option("--depth", type=click.IntRange(min=0), default=None,
              help=f"Module nesting depth shown in the table (default {_default(render_profile_text, 'depth')}).")
@click.option("--top", type=click.IntRange(min=0), default=None,
              help=f"How many nodes, by FLOPs, the table lists (default {_default(render_profile_text, 'top')}).")
@OUTPUT
@file_option("--plot", metavar="FILE.png", help="Draw the memory timeline of the step (needs matplotlib).")
@click.option("--runtime", is_flag=True,
              help="Also run the real model under torch.profiler and compare measured with predicted.")
@click.option("--device", default=None,
              help=f"Where --runtime runs: auto (CUDA if present), cpu, cuda, cuda:N (default {RuntimeOptions.device}).")
@click.option("--steps", type=int, default=None, help=f"--runtime: timed steps (default {RuntimeOptions.steps}).")
@click.option("--warmup", type=int, default=None,
              help=f"--runtime: warm-up steps before them (default {RuntimeOptions.warmup}).")
@click.option("--inference", is_flag=True, help="--runtime: time forward passes under eval() and no_grad().")
@click.option("--force", is_flag=True, help="--runtime: run even if the predicted peak exceeds free memory.")
@file_option("--trace", metavar="FILE.json", help="--runtime: write a Chrome/Perfetto trace, measured beside predicted.")
def profile_command(fmt, by, depth, top, output, plot, runtime, device, steps, warmup, inference, force, trace,
                    **options):
    """Profile PATH.py:NAME (an nn.Module class or factory) on fake tensors.

    \b
    Examples:
      fxacct profile examples/gpt2.py:GPT --batch 8 --dtype bf16
      fxacct profile examples/gpt2.py:GPT --batch 8 --amp bf16 --gpu h100 --world-size 8 --shard zero3
      fxacct profile model.py:make_model --input 'long[B,1024]<50257' --format json -o profile.json

    \b
    Exit codes: 0 success; 2 usage error (also an unwritable -o FILE); 3 the model failed (its
    constructor or forward raised, or --runtime refused because the predicted peak exceeds the
    free memory); 4 an internal error of fxacct; 130 interrupted.
    """
    _check_layout_flags(fmt, by, depth, top)
    config = with_mesh(to_config(**options), **options)
    if plot is not None:
        from fxacct.report.plot import require_matplotlib

        require_matplotlib()
    run_options = _runtime_options(runtime, trace, device=device, steps=steps, warmup=warmup,
                                   inference=inference, force=force)
    if run_options is not None and config.mesh is not None:
        return _mesh_runtime(config, run_options, fmt, output)
    if run_options is not None:
        run = _run_runtime(config, run_options)
        result, prediction = run.profile, run.prediction
    else:
        run, result = None, fxacct.profile(config)
        prediction = predict_profile(result)
    layout = {k: v for k, v in (("depth", depth), ("top", top)) if v is not None}
    _write_reports(result, prediction, run, fmt, by, layout, output, plot, trace)
    if run is not None and run.measured.interrupted:
        click.echo(f"error: interrupted after {run.measured.steps} of {run.measured.steps_requested} timed steps; "
                   "the report shows what was measured", err=True)
        sys.exit(130)


def _write_reports(result, prediction, run, fmt, by, layout, output, plot, trace) -> None:
    if plot is not None:
        from fxacct.report.plot import plot_memory

        plot_memory(result, plot)
        click.echo(f"wrote {plot}", err=True)
    if fmt == "json":
        text = json.dumps(document(result, prediction, run), indent=2) + "\n"
    elif fmt in ("csv", "markdown"):
        text = render_rows(result, fmt, **({"by": by} if by is not None else {}))
    else:
        text = render_profile_text(result, prediction=prediction, runtime=run, **layout)
    write_output(text, output)
    if run is not None and trace is not None:
        from fxacct.report.trace import trace_document

        write_output(json.dumps(trace_document(run.measured.trace_events, run.prediction)) + "\n", trace)


def _run_runtime(config, options: RuntimeOptions):
    """fxacct.runtime.run with a progress bar over warm-up and timed steps on stderr."""
    from fxacct.runtime import run

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


def _mesh_runtime(config, options: RuntimeOptions, fmt: str, output) -> None:
    """--mesh --runtime: the account of rank 0 beside a real multi-process gloo run."""
    from fxacct.parallel.gloo_run import run_mesh
    from fxacct.report.collectives import ranks_json, render_ranks

    if options.device not in ("auto", "cpu") or options.inference:
        raise UsageError("--runtime with --mesh runs CPU processes on gloo: use --device cpu, without --inference")
    result = fxacct.profile(config)
    prediction = predict_profile(result)
    ranks = run_mesh(config, steps=options.steps, warmup=options.warmup)
    peak = result.memory.peak_train.bytes if result.memory.peak_train is not None else None
    if fmt == "json":
        doc = document(result, prediction)
        doc["runtime_ranks"] = ranks_json(result.parallel, ranks, peak)
        text = json.dumps(doc, indent=2) + "\n"
    else:
        text = render_profile_text(result, prediction=prediction) + "\n" + render_ranks(result.parallel, ranks, peak) + "\n"
    write_output(text, output)
