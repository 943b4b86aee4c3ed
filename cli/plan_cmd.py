"""`fxacct plan`: which layout of N GPUs trains fastest and fits."""

from __future__ import annotations

import json
import sys

import click

from fxacct.errors import UsageError
from fxacct.report.plan_text import plan_json, progress_line, render_plan
from fxacct.tools.plan import check_job, default_jobs, plan
from fxacct.tools.plan_cache import default_cache_dir
from fxacct_cli.main import cli, examples, write_output
from fxacct_cli.options import (
    BATCH,
    CONFIRM,
    DEBUG,
    MESH,
    MICROBATCHES,
    OUTPUT,
    OUTPUT_GROUP,
    TORCHTITAN_ARGS,
    format_option,
    group,
    mesh_options,
    model_options,
    terminal_width,
    to_config,
    with_mesh,
)


@cli.command("plan", epilog=examples(
    "fxacct plan examples/llama.py:Llama --gpus 8 --gpu h100 --global-batch 64 --parallelize examples/llama.py:parallelize",
    "fxacct plan examples/llama.py:Llama --gpus 8 --gpu h100 --global-batch 64 --parallelize examples/llama.py:parallelize "
    "--pp-split examples/llama.py:pipeline_stage",
    "fxacct plan torchtitan:llama3:llama3_8b --gpus 8 --gpu h100 --global-batch 16 --format json -o plan.json"))
@model_options(hide=(BATCH,))  # the plan chooses these per layout: not in --help, refused with the reason
@mesh_options(hide=(MESH, MICROBATCHES))
@group("Plan", click.option("--gpus", type=int, required=True, help="GPUs in the job (required)."),
       click.option("--global-batch", type=int, required=True,
                    help="Examples per step over the whole job (required)."), CONFIRM,
       click.option("--jobs", type=click.IntRange(min=1), default=None, metavar="N",
                    help="Worker processes, one mesh's traces each (default: the cores this process may use)."),
       click.option("--no-cache", is_flag=True,
                    help="Keep no traces on disk (default: plan/ in fxacct's cache dir, $FXACCT_CACHE_DIR or "
                         "$XDG_CACHE_HOME/fxacct or ~/.cache/fxacct; safe to delete)."))
@group(OUTPUT_GROUP, format_option("table", "json"), OUTPUT, DEBUG)
@TORCHTITAN_ARGS
def plan_command(fmt, gpus, global_batch, confirm, jobs, no_cache, output, **options):
    """Rank the layouts of --gpus GPUs for MODEL (pp with --pp-split, fsdp, tp, micro-batch,
    activation checkpointing of the repeated blocks off and on) by predicted throughput, among those
    that fit, and say why the others were rejected. A torchtitan:MODULE:CONFIG job (its overrides
    after --) keeps its own checkpointing and pipeline cut; pp is tried under its GPipe or 1F1B schedule.

    \b
    Exit codes: 0 success; 1 no layout fits; 2 usage error; 3 the model failed; 4 an internal error of fxacct.
    """
    given = click.get_current_context().get_parameter_source
    for flag, name in (("--mesh", "mesh"), ("--batch", "batch"), ("--microbatches", "microbatches"),
                       ("--world-size", "world_size"), ("--shard", "shard")):  # its fsdp layouts shard as FSDP2 does
        if given(name) == click.core.ParameterSource.COMMANDLINE:  # the plan chooses each of these per layout
            raise UsageError(f"fxacct plan chooses {flag} for each layout it tries: drop {flag} (give --gpus and "
                             "--global-batch)")
    for flag, name, why in (("--no-max-batch", "no_max_batch", "searches for no largest batch (each layout's micro-batch "
                             "is one it tries)"),
                            ("--zero1", "zero1", "lays out FSDP2 meshes, which shard the optimizer state already")):
        if given(name) == click.core.ParameterSource.COMMANDLINE:  # a flag of profile's that no layout reads
            raise UsageError(f"fxacct plan {why}: drop {flag}")
    check_job(gpus, global_batch)  # before the Config: its mesh is fsdp={gpus}
    config = with_mesh(to_config(**{**options, "mesh": None}), **{**options, "mesh": f"fsdp={gpus}"})
    result = plan(config, gpus, global_batch, confirm, jobs or default_jobs(),
                  None if no_cache else default_cache_dir(), lambda p: click.echo(progress_line(p), err=True))
    text = (json.dumps(plan_json(result), indent=2) + "\n") if fmt == "json" else \
        render_plan(result, gpus, global_batch, config.gpu, terminal_width())
    write_output(text, output)
    if not any(c.fits for c in result.candidates):
        click.echo(f"error: no layout of {gpus} GPUs fits at global batch {global_batch}: each row says why; "
                   "give more --gpus, another --global-batch or a smaller --dtype", err=True)
        sys.exit(1)  # as a failed budget (DESIGN.md exit codes): the GPUs are the budget
