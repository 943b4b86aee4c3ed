"""`fxacct calibrate`: measure this machine's matmul FLOP/s and memory bandwidth, store the device
profile that predictions use (fxacct.tools.calibrate)."""

from __future__ import annotations

import click

from fxacct_cli.main import cli, examples, write_output
from fxacct_cli.options import DEBUG


@cli.command("calibrate", epilog=examples("fxacct calibrate --device cpu", "fxacct calibrate --device cuda",
                                          "fxacct profile examples/mlp.py:MLP --batch 64   # then predicts on this CPU"))
@click.option("--device", default="cpu", show_default=True, help="cpu, or cuda for the local GPU.")
@DEBUG
def calibrate_command(device, debug):
    """Measure what predictions use on the local device: matmul FLOP/s per dtype by shape class,
    convolution FLOP/s by channels, the per-op overhead and memory bandwidth by footprint (~30 s
    on 2 CPU cores). Each figure is repeated until stable (its spread is printed); implausible
    figures are re-measured, and a figure that stays unstable or implausible refuses the whole
    calibration (exit 2; nothing stored: calibrate again on an idle machine). Stored in the user cache dir
    ($FXACCT_CACHE_DIR, else $XDG_CACHE_HOME/fxacct, else ~/.cache/fxacct).

    \b
    Exit codes: 0 success; 2 usage error (e.g. --device cuda without CUDA) or a refused calibration; 4 an internal error
    of fxacct.
    """
    from fxacct.predict import calibration
    from fxacct.report.calibrate_text import render_calibration
    from fxacct.tools import calibrate

    cal = calibrate.calibrate(device, progress=lambda what: click.echo(f"measuring {what}...", err=True))
    path = calibration.save(cal)
    write_output(render_calibration(cal, path), None)
