"""fxacct's Click CLI: flags → Config → one library call → report → exit code. No arithmetic here.

Exit codes (DESIGN.md): 0 success; 1 a budget or threshold failed; 2 usage error; 3 the model
failed; 4 an internal error of fxacct (a bug to report). Every error is one line on stderr;
--debug adds the traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback

import click
import cloup

from fxacct.errors import INTERNAL_HINT, USER_FRAMES_HINT, FxacctError, ModelError, classify, internal_error
from fxacct.heap import one_command_process


def _fail(e: FxacctError, debug: bool):
    message = str(e)
    if debug:  # the traceback is printed: the line no longer asks for --debug
        traceback.print_exc()
        message = message.replace(f"; {USER_FRAMES_HINT}", "").replace(f"; {INTERNAL_HINT}",
                                                                       "; report it with the traceback above")
    click.echo(f"error: {message}", err=True)
    sys.exit(e.exit_code)


# command name -> (its module under fxacct_cli, its one-line help as `fxacct --help` lists it). A
# command's module (and with it torch) is imported only when that command runs or shows its help;
# tests/test_help.py holds each line equal to the command's own.
COMMANDS = {
    "calibrate": ("calibrate_cmd", "Measure what predictions use on the local device: matmul FLOP/s per dtype by shape "
                                   "class, convolution FLOP/s by channels, the per-op overhead and memory bandwidth by "
                                   "footprint (~30 s on 2 CPU cores)."),
    "check": ("check_cmd", "Profile MODEL (PATH.py:Name, package.module:Name or hf:PATH) and check it against budgets."),
    "diff": ("diff_cmd", "Compare two `fxacct profile --format json` files of the same schema version; --format "
                         "markdown gives the verdict and change tables for a pull-request comment."),
    "estimate": ("estimate_cmd", "Back-of-envelope calculators: train-time, max-params, flops (every constant sourced)."),
    "plan": ("plan_cmd", "Rank the layouts of --gpus GPUs for MODEL (pp with --pp-split, fsdp, tp, micro-batch, "
                         "activation checkpointing of the repeated blocks off and on) by predicted throughput, among "
                         "those that fit, and say why the others were rejected."),
    "profile": ("profile_cmd", "Profile MODEL on fake tensors: PATH.py:Name or package.module:Name (an nn.Module class "
                               "or factory), hf:DIR_OR_CONFIG_JSON (a Hugging Face model from a local config), or "
                               "torchtitan:MODULE:CONFIG (a torchtitan job, its overrides after --)."),
}


def short_help(name: str, limit: int) -> str:
    """A command's line in `fxacct --help`, cut as click cuts its own help (Command.get_short_help_str)."""
    return click.Command(name, help=COMMANDS[name][1]).get_short_help_str(limit)


_REPORT_STREAMS: list = []  # the stdout each running command's report goes to (FxacctCommand.invoke)


class FxacctCommand(cloup.Command):
    """A command whose run sends what else reaches stdout (a model's own print) to stderr, so that
    stdout carries its report alone (``--format json | jq``); write_output writes the report to the
    stdout the command found. Help and usage errors come before the run, where click prints them."""

    def invoke(self, ctx):
        _REPORT_STREAMS.append(sys.stdout)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                return super().invoke(ctx)
        finally:
            _REPORT_STREAMS.pop()


class FxacctGroup(cloup.Group):
    """Turns click's usage errors into one line on stderr and exit 2, and fxacct's errors into
    their own exit codes, for every command; loads each command's module when it is asked for."""

    command_class = FxacctCommand

    def list_commands(self, ctx) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx, name: str):
        if name in COMMANDS and name not in self.commands:
            importlib.import_module(f"fxacct_cli.{COMMANDS[name][0]}")  # registers it on `cli`
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter) -> None:
        """The command list of `fxacct --help`, from COMMANDS: no command module is imported."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)  # as click.Group.format_commands
        with formatter.section("Commands"):
            formatter.write_dl([(name, short_help(name, limit)) for name in names])

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
            _fail(e, debug)
        except SystemExit as e:  # a command's own exit code passes; the model's sys.exit is its failure (exit 3)
            blamed = classify(e, "the model's code")
            if not isinstance(blamed, ModelError):
                raise
            _fail(blamed, debug)
        except Exception as e:  # a bug in fxacct: exit 4, never a budget's 1 nor usage's 2
            _fail(internal_error(e), debug)


HELP_SETTINGS = cloup.Context.settings(help_option_names=["-h", "--help"], align_option_groups=False,
                                       formatter_settings=cloup.HelpFormatter.settings(max_width=100))


def examples(*lines: str) -> str:
    """The epilog that ends a command's help: two or three example command lines."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


@click.group(cls=FxacctGroup, context_settings=HELP_SETTINGS,
             epilog=examples("fxacct profile examples/gpt2.py:GPT --batch 8 --dtype bf16 --gpu h100",
                             "fxacct check model.py:Model --batch 32 --amp bf16 --gpu h100 --max-memory 80GB",
                             "fxacct estimate train-time --params 70e9 --tokens 15e12 --gpu h100 --world-size 1024"))
@click.version_option(package_name="fxacct", prog_name="fxacct")
def cli():
    """What one training step of a PyTorch model costs: FLOPs, bytes and time, node by node,
    computed on fake tensors (no weights are allocated).

    \b
    Exit codes: 0 success, 1 a budget failed (check, diff), 2 usage error, 3 the model failed,
    4 an internal error of fxacct (rerun with --debug and report it).
    """


def report_stream():
    """The stdout a command's report goes to: the one it found, while its run sends the rest to
    stderr (FxacctCommand); whether it is a terminal is asked of this one."""
    return _REPORT_STREAMS[-1] if _REPORT_STREAMS else sys.stdout


def write_output(text: str, path: str | None) -> None:
    """Print to stdout (no path, or '-'), or write the file atomically (fxacct.report.files)."""
    if path is None or path == "-":
        click.echo(text, nl=False, file=report_stream())
        return
    from fxacct.report.files import write_text

    write_text(path, text)
    click.echo(f"wrote {path}", err=True)



def main() -> None:
    """The console script: run the command, flush what it wrote, and leave without the interpreter's
    teardown. Unloading torch, transformers and their extension modules at exit costs 0.5-1 s of
    wall time on a 2-core machine (measured: `import torch, transformers` with and without
    os._exit), a fifth of a small model's whole answer; every command has finished its work (files
    written atomically, worker pools shut down by their `with` blocks) before this point. For the
    same reason its garbage collector is off: what it would free, the exit frees
    (fxacct.heap.one_command_process)."""
    one_command_process()
    code = run()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader that closed the pipe, or a closed stream
            code = code or 1
    os._exit(code)


def run() -> int:
    """Run the command line in sys.argv; its exit code."""
    try:
        cli()
    except SystemExit as e:
        return exit_code(e.code)
    return 0


def exit_code(code: object) -> int:
    """What SystemExit(code) would make the process return: None is 0, an int itself, a message
    is printed to stderr and is 1 (as the interpreter does)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


__all__ = ["cli", "main", "run", "report_stream", "write_output", "examples"]
