"""`fxacct check`: the profile plus budgets, with an exit code CI can act on (0 every budget
holds, 1 one is over, 2 usage error, 3 the model failed)."""

from __future__ import annotations

import dataclasses
import json
import sys

import click

import fxacct
from fxacct.tools.budgets import DEFAULT_MFU, Limits, evaluate, validate
from fxacct.errors import UsageError
from fxacct.load.quantities import parse_count, parse_duration
from fxacct.report import document
from fxacct.report.check_text import check_document, render_check
from fxacct.units import parse_bytes
from fxacct_cli.main import cli, write_output
from fxacct_cli.options import model_options, to_config


def _bytes(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise UsageError(f"--max-memory: {e}") from None
    if value <= 0:
        raise UsageError(f"--max-memory must be positive, got {text}")
    return value


@cli.command("check")
@model_options
@click.option("--max-memory", default=None, metavar="SIZE",
              help="Per-rank training peak budget, e.g. 80GB, 79.6GiB, 512MiB (GB = 1e9 B, GiB = 2^30 B). "
                   "Default with --gpu: its capacity as the driver reports it (H100: 81559 MiB).")
@click.option("--max-params", default=None, metavar="N", help="Parameter budget, e.g. 7e9 or 7B.")
@click.option("--max-flops", default=None, metavar="N", help="Forward+backward FLOPs per step (per rank).")
@click.option("--max-flops-per-example", default=None, metavar="N", help="Forward+backward FLOPs per example.")
@click.option("--max-step-time", default=None, metavar="TIME",
              help="Step time budget (250ms, 1.5s): model FLOPs at the --gpu's peak × --mfu.")
@click.option("--mfu", type=float, default=DEFAULT_MFU, show_default=True,
              help="Assumed model FLOPs utilization for --max-step-time, in (0, 1].")
@click.option("--require-no-unsupported-ops", is_flag=True, help="Fail when an op has no cost formula.")
@click.option("--format", "fmt", type=click.Choice(("table", "json")), default="table", show_default=True)
@click.option("-o", "--output", default=None, metavar="FILE", help="Write to FILE (atomically) instead of stdout.")
def check_command(max_memory, max_params, max_flops, max_flops_per_example, max_step_time, mfu,
                  require_no_unsupported_ops, fmt, output, **options):
    """Profile PATH.py:NAME and check it against budgets.

    \b
    Examples:
      fxacct check model.py:Model --batch 32 --amp bf16 --gpu h100 --world-size 8 --shard zero2
      fxacct check model.py:Model --max-memory 40GB --max-params 7B --require-no-unsupported-ops
      fxacct check model.py:Model --gpu h100 --max-step-time 500ms --mfu 0.4 --format json

    Exit codes: 0 every budget holds, 1 a budget is over (the table says which and by how much),
    2 usage error, 3 the model failed.
    """
    limits = Limits(
        max_memory_bytes=_bytes(max_memory),
        max_params=parse_count(max_params, "--max-params") if max_params is not None else None,
        max_flops=parse_count(max_flops, "--max-flops") if max_flops is not None else None,
        max_flops_per_example=(parse_count(max_flops_per_example, "--max-flops-per-example")
                               if max_flops_per_example is not None else None),
        max_step_seconds=parse_duration(max_step_time, "--max-step-time") if max_step_time is not None else None,
        mfu=mfu, require_no_unsupported_ops=require_no_unsupported_ops)
    config = dataclasses.replace(to_config(**options), find_max_batch=False)
    validate(limits, config.gpu)
    profile = fxacct.profile(config)
    result = evaluate(profile, limits)
    if fmt == "json":
        text = json.dumps(check_document(result, document(profile)), indent=2) + "\n"
    else:
        text = render_check(result)
    write_output(text, output)
    if not result.ok:
        sys.exit(1)  # a budget is over (DESIGN.md exit codes); click's ctx.exit would be swallowed
