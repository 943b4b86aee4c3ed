"""Flags given on the command line that would change nothing where they are given: a usage error,
as --microbatches without pp is (their defaults pass)."""

from __future__ import annotations

import click

from fxacct.errors import UsageError
from fxacct.load.mesh import no_pipeline


def refuse_idle_flags(mesh) -> None:
    """--gpus-per-node without --mesh, --pp-schedule without pp, --[no-]reshard-after-forward
    without fsdp and --no-max-batch without --gpu, given on the command line, would change nothing:
    a usage error, as --microbatches without pp is (their defaults pass)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return
    given = {name for name in ("gpus_per_node", "pp_schedule", "reshard_after_forward", "no_max_batch")
             if name in ctx.params and ctx.get_parameter_source(name) in (
                 click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)}
    if "reshard_after_forward" in given:
        _refuse_idle_reshard(ctx.params, mesh)
    if "no_max_batch" in given and ctx.params.get("gpu") is None:
        raise UsageError("--no-max-batch skips the largest-batch search, which runs with --gpu only: drop it")
    if mesh is None and "gpus_per_node" in given:
        raise UsageError("--gpus-per-node says how the ranks of a --mesh sit on nodes, and one device has none: "
                         "add --mesh (e.g. --mesh fsdp=8) or drop --gpus-per-node")
    if "gpus_per_node" in given and "gpu" in ctx.params and ctx.params.get("gpu") is None:
        raise UsageError("--gpus-per-node places the ranks on nodes to time their communication, which needs a "
                         "GPU's links: add --gpu NAME or drop --gpus-per-node")
    if "pp_schedule" in given and (mesh is None or mesh.size("pp") == 1):
        raise UsageError(f"--pp-schedule says how a pipeline runs, but {no_pipeline(mesh)} or drop --pp-schedule")


def _refuse_idle_reshard(params: dict, mesh) -> None:
    """--[no-]reshard-after-forward sets fxacct's own FSDP2 wrapping: without an fsdp dimension,
    or where the user's --parallelize or torchtitan wraps the model, it would change nothing."""
    flag = "--reshard-after-forward" if params["reshard_after_forward"] else "--no-reshard-after-forward"
    if mesh is None or mesh.size("fsdp") == 1:
        raise UsageError(f"{flag} says what FSDP2 does after a block's forward, and --mesh has no fsdp dimension: "
                         f"add one (e.g. --mesh fsdp=8) or drop {flag}")
    if params.get("parallelize") is not None:
        raise UsageError(f"{flag} sets fxacct's own FSDP2 wrapping, and --parallelize wraps the model itself: "
                         f"pass reshard_after_forward to fully_shard in it, or drop {flag}")
    if str(params.get("target", "")).startswith("torchtitan:"):
        raise UsageError(f"{flag} sets fxacct's own FSDP2 wrapping, and torchtitan wraps its model itself "
                         f"(its parallelism.fsdp_reshard_after_forward): drop {flag}")


__all__ = ["refuse_idle_flags"]
