"""`--help`: options in titled groups (cloup), every option described with its default, and every
command's help ending with two or three example command lines."""

from __future__ import annotations

import re

import click
import cloup
import pytest
from click.testing import CliRunner

from fxacct_cli.main import HELP_SETTINGS, cli


def commands(group: click.Group = cli, path: tuple[str, ...] = ()):
    """(command path, command) for every command and group under ``group``, itself included."""
    yield path, group
    if isinstance(group, click.Group):  # the lazy group loads each command as click does
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            yield from commands(group.get_command(ctx, name), (*path, name))


ALL = list(commands())
IDS = [" ".join(p) or "fxacct" for p, _ in ALL]


def help_text(path) -> str:
    result = CliRunner().invoke(cli, [*path, "--help"], env={"COLUMNS": "100"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def default_is_shown(option: click.Option) -> bool:
    """A default is shown by click ([default: ...]) or said in the help text; a flag is off unless
    given, a repeatable option empty, a required one has none."""
    if option.is_flag or option.multiple or option.required:
        return True
    if option.show_default and option.default is not None:
        return True
    return "default" in (option.help or "").lower()


@pytest.mark.parametrize("path, command", ALL, ids=IDS)
def test_every_option_has_help_and_its_default(path, command):
    # the CLI's own settings: click caches a command's help option from the first context made
    ctx = cloup.Context(command, **HELP_SETTINGS)
    missing = [o.name for o in command.get_params(ctx) if isinstance(o, click.Option) and not (o.help or "").strip()]
    assert not missing, missing
    hidden_default = [o.name for o in command.params if isinstance(o, click.Option) and not default_is_shown(o)]
    assert not hidden_default, hidden_default


@pytest.mark.parametrize("path, command", ALL, ids=IDS)
def test_help_ends_with_two_or_three_examples(path, command):
    lines = help_text(path).rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(lines) if line.strip() == "Examples:")
    examples = [line.strip() for line in lines[start + 1:]]
    assert 2 <= len(examples) <= 3, lines[start:]
    assert all(e.startswith("fxacct ") for e in examples), examples


def test_profile_help_shows_the_option_groups_in_order():
    text = help_text(("profile",))
    headings = ["Model and inputs:", "Precision and optimizer:", "Hardware and parallelism:", "Output:",
                "Runtime (a real run):"]
    where = [text.find(f"\n{h}\n") for h in headings]
    assert all(i >= 0 for i in where) and where == sorted(where), (where, text)
    # each option sits under its group: --batch before precision, --dtype before hardware, ...
    for flag, group in (("--batch", 0), ("--amp", 1), ("--shard", 2), ("--summary", 3), ("--steps", 4)):
        i = text.find(f" {flag} ")
        assert where[group] < i and (group == 4 or i < where[group + 1]), (flag, text)


def test_check_help_groups_budgets():
    text = help_text(("check",))
    assert "\nBudgets:\n" in text and "\nModel and inputs:\n" in text, text


def test_plan_help_leaves_out_the_flags_plan_chooses_itself():
    text = CliRunner().invoke(cli, ["plan", "--help"], terminal_width=200).output
    options = set(re.findall(r"^\s+(-[-\w]+(?:, --[-\w]+)?)", text, re.M))
    flags = {f.strip() for o in options for f in o.split(",")}
    assert {"--gpus", "--global-batch", "--parallelize", "--pp-split"} <= flags, flags
    assert not {"--mesh", "--batch", "-b", "--microbatches"} & flags, flags  # plan refuses them


def test_mesh_help_lists_every_mesh_dimension():
    from fxacct.load.mesh import DIMS

    for command in ("profile", "check"):
        text = " ".join(CliRunner().invoke(cli, [command, "--help"], terminal_width=200).output.split())
        mesh = text[text.index("--mesh DIM=N,..."):][:200]
        assert f"outer to inner ({', '.join(DIMS)})" in mesh, mesh
        assert all(d in mesh for d in ("pp", "dp", "fsdp", "tp")), mesh


@pytest.mark.parametrize("limit", [45, 80, 300])
def test_the_command_list_is_each_commands_own_help(limit):
    """`fxacct --help` lists the commands without importing them (fxacct_cli.main.COMMANDS): each
    line is what the command's own help gives, at any width."""
    from fxacct_cli.main import COMMANDS, short_help

    assert sorted(cli.commands) == sorted(COMMANDS) and len(ALL) > 8  # ALL above loaded every command
    for name, command in cli.commands.items():
        assert short_help(name, limit) == command.get_short_help_str(limit), name


def test_help_and_version_do_not_import_torch():
    """`fxacct --help` and `--version` answer before torch is imported (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from fxacct_cli.main import cli; "
            "r = [CliRunner().invoke(cli, [a]) for a in ('--help', '--version')]; "
            "assert all(x.exit_code == 0 for x in r), [x.output for x in r]; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
