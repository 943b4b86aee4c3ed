"""`fxacct check`: the profile plus budgets, with an exit code CI can act on (0 every budget
holds, 1 one is over, 2 usage error, 3 the model failed)."""

from __future__ import annotations

import dataclasses
import json
import sys

import click

import fxacct
from fxacct.load.quantities import parse_duration
from fxacct_cli.idle_flags import refuse_idle_flags
from fxacct_cli.main import cli, examples, write_output
from fxacct_cli.options import (
    DEBUG,
    MFU,
    OUTPUT,
    OUTPUT_GROUP,
    count_or_none,
    format_option,
    group,
    max_memory_option,
    mesh_options,
    model_options,
    to_config,
    with_mesh,
)

BUDGETS = [
    max_memory_option("Per-rank memory budget, e.g. 80GB, 79.6GiB, 512MiB (GB = 1e9 B, GiB = 2^30 B). With --gpu it "
                      "applies to the step's peak reserved by the CUDA caching allocator plus the fixed costs outside "
                      "it (CUDA context, NCCL buffers); without, to the training peak. Default with --gpu: its "
                      "capacity as the driver reports it (H100: 81559 MiB); else none."),
    click.option("--max-params", default=None, metavar="N", help="Parameter budget, e.g. 7e9 or 7B (default: none)."),
    click.option("--max-flops", default=None, metavar="N",
                 help="Forward+backward FLOPs per step (per rank) (default: none)."),
    click.option("--max-flops-per-example", default=None, metavar="N",
                 help="Forward+backward FLOPs per example (default: none)."),
    click.option("--max-step-time", default=None, metavar="TIME",
                 help="Step time budget (250ms, 1.5s; a bare number is seconds): model FLOPs at the --gpu's peak × --mfu "
                      "(default: none)."),
    MFU,
    click.option("--require-no-unsupported-ops", is_flag=True, help="Fail when an op has no cost formula."),
]


@cli.command("check", epilog=examples(
    "fxacct check model.py:Model --batch 32 --amp bf16 --gpu h100 --world-size 8 --shard zero2",
    "fxacct check model.py:Model --max-memory 40GB --max-params 7B --require-no-unsupported-ops",
    "fxacct check examples/llama.py:Llama --gpu h100 --mesh fsdp=2,tp=2 --parallelize examples/llama.py:parallelize"))
@model_options
@mesh_options
@group("Budgets", *BUDGETS)
@group(OUTPUT_GROUP, format_option("table", "json"), OUTPUT, DEBUG)
def check_command(max_memory, max_params, max_flops, max_flops_per_example, max_step_time, mfu,
                  require_no_unsupported_ops, fmt, output, **options):
    """Profile MODEL (PATH.py:Name, package.module:Name or hf:PATH) and check it against budgets.

    \b
    Exit codes: 0 every budget holds; 1 a budget is over (the table says which and by how much);
    2 usage error; 3 the model failed; 4 an internal error of fxacct.
    """
    budgets = dict(
        max_memory_bytes=max_memory, max_params=count_or_none(max_params, "--max-params"),
        max_flops=count_or_none(max_flops, "--max-flops"),
        max_flops_per_example=count_or_none(max_flops_per_example, "--max-flops-per-example"),
        max_step_seconds=parse_duration(max_step_time, "--max-step-time") if max_step_time is not None else None,
        mfu=mfu, require_no_unsupported_ops=require_no_unsupported_ops)
    refuse_idle_flags(options.get("mesh"))
    config = dataclasses.replace(with_mesh(to_config(**options), **options), find_max_batch=False)
    # torch comes in with Config (to_config): every flag that needs no torch has been checked
    from fxacct.report import document
    from fxacct.report.check_text import check_document, render_check
    from fxacct.tools.budgets import Limits, check_mesh, evaluate, validate

    limits = Limits(**budgets)
    validate(limits, config.gpu)
    check_mesh(limits, config.mesh)
    profile = fxacct.profile(config)
    result = evaluate(profile, limits)
    if fmt == "json":
        text = json.dumps(check_document(result, document(profile, profile.prediction)), indent=2) + "\n"
    else:
        text = render_check(result)
    write_output(text, output)
    if not result.ok:
        sys.exit(1)  # a budget is over (DESIGN.md exit codes); click's ctx.exit would be swallowed
