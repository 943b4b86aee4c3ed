"""`fxacct profile`: the account of one training step, as tables, JSON, CSV, Markdown or HTML.

torch comes in with the first library call, after every flag is checked (tests/test_startup.py)."""

from __future__ import annotations

import json
import sys

import click

import fxacct
from fxacct.errors import InternalError, ModelError, UsageError
from fxacct.load.flags import DEFAULT_DEPTH, DEFAULT_TOP
from fxacct.load.run_options import RuntimeOptions
from fxacct_cli.idle_flags import refuse_idle_flags
from fxacct_cli.main import cli, examples, report_stream, write_output
from fxacct_cli.options import (
    DEBUG,
    FORMATS,
    OUTPUT,
    OUTPUT_GROUP,
    RUNTIME_GROUP,
    TORCHTITAN_ARGS,
    file_option,
    format_option,
    group,
    mesh_options,
    model_options,
    terminal_width,
    to_config,
    with_mesh,
)


def _check_layout_flags(fmt: str, by, depth, top, summary_only=False, wide=False) -> None:
    """--by picks csv/markdown rows; --depth, --top and --wide shape the table, --summary the table
    or markdown: elsewhere they would do nothing, so they are refused rather than ignored."""
    if by is not None and fmt not in ("csv", "markdown"):
        raise UsageError(f"--by chooses the rows of --format csv or markdown; the {fmt} output has "
                         "both modules and nodes: drop --by or add --format csv")
    if summary_only and fmt not in ("table", "markdown"):
        raise UsageError(f"--summary shortens the table or markdown output; --format {fmt} writes "
                         "everything: drop --summary")
    if wide and fmt != "table":
        raise UsageError(f"--wide shapes the text table; --format {fmt} is never cut: drop --wide")
    for flag, value in (("--depth", depth), ("--top", top)):
        if value is not None and fmt != "table" and not (fmt == "markdown" and flag == "--depth"):
            raise UsageError(f"{flag} shapes the text table; --format {fmt} writes every "
                             f"{'module' if flag == '--depth' else 'node'}: drop {flag}")


def _check_html_destination(fmt: str, output) -> None:
    """An HTML page (hundreds of KB, one line of JSON) written to a terminal is of no use to read:
    refused there, before the work; a pipe or a file takes it."""
    if fmt == "html" and output in (None, "-") and report_stream().isatty():
        raise UsageError("--format html writes a whole page, not for a terminal: add -o FILE.html "
                         "(or pipe stdout to a file)")


def _runtime_options(runtime: bool, trace, **given) -> RuntimeOptions | None:
    """The RuntimeOptions of the flags given (the library's defaults for the rest), or None
    without --runtime, where any of them is refused rather than ignored."""
    given = {k: v for k, v in given.items() if v is not None and v is not False}
    if not runtime:
        flags = [f"--{k}" for k in given] + (["--trace"] if trace is not None else [])
        if flags:
            raise UsageError(f"{', '.join(flags)} {'takes' if len(flags) == 1 else 'take'} effect with --runtime: "
                             "add --runtime")
        return None
    return RuntimeOptions(**given, keep_trace=trace is not None)


PROFILE_OUTPUT = [
    format_option(*FORMATS),
    click.option("--summary", "summary_only", is_flag=True,
                 help="Print only the one-screen summary (table and markdown formats)."),
    click.option("--wide", is_flag=True,
                 help="Do not fit the table to the terminal (default: fit COLUMNS, or the terminal's width; "
                      "no limit when stdout is not a terminal)."),
    click.option("--by", type=click.Choice(("node", "module")), default=None,
                 help="Rows of the csv/markdown table (default: node for csv, module for markdown)."),
    click.option("--depth", type=click.IntRange(min=0), default=None,
                 help=f"Module nesting depth shown in the table and the markdown (default {DEFAULT_DEPTH})."),
    click.option("--top", type=click.IntRange(min=0), default=None,
                 help=f"How many nodes, by FLOPs, the table lists (default {DEFAULT_TOP})."),
    OUTPUT,
    file_option("--plot", metavar="FILE.png", help="Draw the memory timeline of the step (needs matplotlib; default: no plot)."),
    DEBUG,
]
PROFILE_RUNTIME = [
    click.option("--runtime", is_flag=True,
                 help="Also run the real model under torch.profiler and compare measured with predicted."),
    click.option("--device", default=None,
                 help=f"Where --runtime runs: auto (CUDA if present), cpu, cuda, cuda:N (default {RuntimeOptions.device})."),
    click.option("--steps", type=int, default=None, help=f"Timed steps (default {RuntimeOptions.steps})."),
    click.option("--warmup", type=int, default=None,
                 help=f"Warm-up steps before them (default {RuntimeOptions.warmup})."),
    click.option("--inference", is_flag=True, help="Time forward passes under eval() and no_grad()."),
    click.option("--force", is_flag=True, help="Run even if the predicted peak exceeds free memory."),
    file_option("--trace", metavar="FILE.json", help="Write a Chrome/Perfetto trace, measured beside predicted (default: none)."),
]


@cli.command("profile", epilog=examples(
    "fxacct profile examples/gpt2.py:GPT --batch 8 --dtype bf16 --gpu h100 --summary",
    "fxacct profile torchtitan:llama3:llama3_8b --mesh fsdp=8 --batch 1 --format json -o profile.json",
    "fxacct profile hf:path/to/config.json --batch 4 --seq-len 512 --loss cross-entropy"))
@model_options
@TORCHTITAN_ARGS
@mesh_options
@group(OUTPUT_GROUP, *PROFILE_OUTPUT)
@group(RUNTIME_GROUP, *PROFILE_RUNTIME)
def profile_command(fmt, summary_only, wide, by, depth, top, output, plot, runtime, device, steps, warmup, inference,
                    force, trace, **options):
    """Profile MODEL on fake tensors: PATH.py:Name or package.module:Name (an nn.Module class or
    factory), hf:DIR_OR_CONFIG_JSON (a Hugging Face model from a local config), or
    torchtitan:MODULE:CONFIG (a torchtitan job, its overrides after --). A one-screen summary, then
    memory, modules, top nodes and the predicted step time.

    \b
    Exit codes: 0 success; 2 usage error (also an unwritable -o FILE); 3 the model failed (its
    constructor or forward raised, or --runtime refused because the predicted peak exceeds the
    free memory); 4 an internal error of fxacct; 130 interrupted.
    """
    _check_layout_flags(fmt, by, depth, top, summary_only, wide)
    _check_html_destination(fmt, output)
    refuse_idle_flags(options.get("mesh"))
    config = with_mesh(to_config(**options), **options)
    if plot is not None:
        from fxacct.report.plot import require_matplotlib

        require_matplotlib(plot)
    run_options = _runtime_options(runtime, trace, device=device, steps=steps, warmup=warmup,
                                   inference=inference, force=force)
    if run_options is not None and (config.target or "").startswith("torchtitan:") and (
            config.mesh is None or config.mesh.size("pp") > 1):
        raise UsageError("--runtime with a torchtitan target runs its ranks for real on gloo, without pipeline "
                         "parallelism: give --mesh (e.g. --mesh fsdp=2,ep=2; --mesh fsdp=1 for one process) "
                         "without pp, or drop --runtime")
    layout = {k: v for k, v in (("depth", depth), ("top", top)) if v is not None}
    layout.update(summary_only=summary_only, width=None if wide else terminal_width())
    if run_options is not None and config.compiled and (config.mesh is not None or config.checkpoint):
        raise UsageError(f"--runtime with --compile and {'--mesh' if config.mesh is not None else '--checkpoint'}: "
                         "the real check compiles on one device without checkpointing; drop --runtime (the tests "
                         "check those accounts against real compiled runs), or drop that flag")
    if run_options is not None and config.compiled and run_options.warmup < 1:
        raise UsageError(f"--warmup {run_options.warmup} with --compile: the first step compiles the model, so "
                         "no timed step may be it; give --warmup 1 or more")
    if run_options is not None and config.mesh is not None:
        return _mesh_runtime(config, run_options, fmt, output, layout)
    if run_options is not None and fmt in ("csv", "markdown"):  # before the run: the report would leave it out
        raise UsageError(f"--format {fmt} carries no runtime figures: use --format table, json or html with "
                         "--runtime, or drop --runtime")
    if run_options is not None:
        run = _run_runtime(config, run_options)
        result, prediction = run.profile, run.prediction
    else:
        run, result = None, fxacct.profile(config)
        prediction = result.prediction
    _write_reports(result, prediction, run, fmt, by, layout, output, plot, trace)
    if run is not None and run.measured.interrupted:
        click.echo(f"error: interrupted after {run.measured.steps} of {run.measured.steps_requested} timed steps; "
                   "the report shows what was measured", err=True)
        sys.exit(130)


def _write_reports(result, prediction, run, fmt, by, layout, output, plot, trace) -> None:
    from fxacct.report import render

    if plot is not None:
        from fxacct.report.plot import plot_memory

        plot_memory(result, plot)
        click.echo(f"wrote {plot}", err=True)
    if fmt in ("json", "csv"):  # the document carries them (json: "warnings"); a terminal shows them too
        for w in result.warnings:
            click.echo(f"warning: {w}", err=True)
    text = render(result, fmt, prediction, run, by=by, depth=layout.get("depth"), top=layout.get("top"),
                  summary_only=layout["summary_only"], width=layout["width"])
    write_output(text, output)
    if run is not None and trace is not None:
        from fxacct.report.trace import trace_document

        write_output(json.dumps(trace_document(run.measured.trace_events, run.prediction)) + "\n", trace)


def _run_runtime(config, options: RuntimeOptions):
    """fxacct.runtime.run with its progress on stderr (a bar on a terminal, a line per phase otherwise)."""
    from fxacct.runtime import run
    from fxacct.runtime.progress import Progress

    with Progress() as progress:
        return run(config, options, progress)


def _mesh_runtime(config, options: RuntimeOptions, fmt: str, output, layout: dict) -> None:
    """--mesh --runtime: the account of rank 0 beside a real multi-process gloo run."""
    from fxacct.report import document
    from fxacct.report.collectives import ranks_json, render_ranks
    from fxacct.report.text import render_profile_text
    from fxacct.runtime.gloo_run import check_runnable, run_mesh

    check_runnable(config)
    if options.keep_trace:  # the ranks run without torch.profiler: no events to write
        raise UsageError("--trace with --mesh --runtime: the real run of the ranks records no profiler trace; "
                         "drop --trace, or trace one device's run without --mesh")
    if options.device not in ("auto", "cpu"):
        raise UsageError(f"--device {options.device} with --mesh --runtime: the ranks run as CPU processes on gloo; "
                         "use --device cpu")
    if options.inference:
        raise UsageError("--inference with --mesh --runtime: the ranks run training steps only (the rank's "
                         "inference peak is predicted, not measured); drop --inference")
    if fmt not in ("table", "json"):
        raise UsageError(f"--format {fmt} with --mesh --runtime: the ranks' measurements are a table of their "
                         "own, written as a table or as JSON (runtime_ranks); use --format table or json")
    if config.gpu is not None:
        raise UsageError(f"--gpu {config.gpu} is a CUDA target but the real run with --mesh runs CPU processes: "
                         "drop --gpu to compare with them")
    result = fxacct.profile(config)
    prediction = result.prediction
    try:
        ranks = run_mesh(config, steps=options.steps, warmup=options.warmup)
    except (ModelError, InternalError):  # the real run failed: the account stands, then the error's line
        _write_reports(result, prediction, None, fmt, None, layout, output, None, None)
        raise
    peak = result.memory.peak_train.bytes if result.memory.peak_train is not None else None
    if fmt == "json":
        doc = document(result, prediction)
        doc["runtime_ranks"] = ranks_json(result.parallel, ranks, peak)
        text = json.dumps(doc, indent=2) + "\n"
    else:
        text = (render_profile_text(result, prediction=prediction, **layout) + "\n"
                + render_ranks(result.parallel, ranks, peak, layout["width"]) + "\n")
    write_output(text, output)
