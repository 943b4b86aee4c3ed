"""fxacct's Click CLI: flags → Config → one library call → report → exit code. No arithmetic here.

Exit codes (DESIGN.md): 0 success; 1 a budget or threshold failed; 2 usage error; 3 the model
failed; 4 an internal error of fxacct (a bug to report). Every error is one line on stderr;
--debug adds the traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

import click

from fxacct.errors import FxacctError, UsageError

FORMATS = ("table", "json", "csv", "markdown")
INTERNAL_ERROR = 4  # an fxacct bug: CI must not read it as "over budget" (1) or "usage" (2)


class FxacctGroup(click.Group):
    """Turns click's usage errors into one line on stderr and exit 2, and fxacct's errors into
    their own exit codes, for every command."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        debug = "--debug" in (sys.argv[1:] if args is None else list(args))
        try:
            return super().main(args=args, prog_name=prog_name or "fxacct", complete_var=complete_var,
                                standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            sys.exit(0)
        except click.ClickException as e:
            hint = ""
            if isinstance(e, click.UsageError) and e.ctx is not None:
                hint = f" (see '{e.ctx.command_path} --help')"
            click.echo(f"error: {e.format_message()}{hint}", err=True)
            sys.exit(2 if isinstance(e, click.UsageError) else e.exit_code)
        except click.exceptions.Abort:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except FxacctError as e:
            if debug:
                traceback.print_exc()
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except Exception as e:  # a bug in fxacct: its own exit code, never a budget's 1 nor usage's 2
            if debug:
                traceback.print_exc()
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            click.echo(f"error: internal error {type(e).__name__}: {first} (rerun with --debug and report it)",
                       err=True)
            sys.exit(INTERNAL_ERROR)


@click.group(cls=FxacctGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fxacct", prog_name="fxacct")
def cli():
    """What one training step of a PyTorch model costs: FLOPs, bytes and time, node by node,
    computed on fake tensors (no weights are allocated)."""


def write_output(text: str, path: str | None) -> None:
    """Print, or write atomically: a temporary file beside the target, then rename over it."""
    if path is None or path == "-":
        click.echo(text, nl=False)
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory; give a file name such as {target / 'profile.json'}")
    if not target.parent.exists():
        raise UsageError(f"cannot write {path}: directory {target.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    click.echo(f"wrote {path}", err=True)


from fxacct_cli import profile_cmd  # noqa: E402,F401  (registers the command)
from fxacct_cli import check_cmd  # noqa: E402,F401
from fxacct_cli import diff_cmd  # noqa: E402,F401
from fxacct_cli import estimate_cmd  # noqa: E402,F401
from fxacct_cli import calibrate_cmd  # noqa: E402,F401


def main() -> None:
    cli()


__all__ = ["cli", "main", "write_output", "FORMATS"]
