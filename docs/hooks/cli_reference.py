"""mkdocs hook: writes the CLI reference (docs/cli.md) from the Click commands at build time.

The page holds a marker, `<!-- cli-reference -->`; this hook replaces it with every command's
`--help` text, recursing over groups, so the reference cannot drift from the code. It imports the
`cli/` folder of the repository that holds mkdocs.yml (as the package `fxacct_cli`), never another
installed copy.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
WIDTH = 100  # the help formatter's max_width (fxacct_cli.main.HELP_SETTINGS)


def _load_cli(root: Path):
    """`fxacct_cli.main:cli` from root/cli, with root first on sys.path (so `fxacct` is root's too)."""
    if str(root) not in sys.path[:1]:
        sys.path.insert(0, str(root))
    cli_dir = root / "cli"
    for package, folder in (("fxacct", root / "fxacct"), ("fxacct_cli", cli_dir)):
        loaded = sys.modules.get(package)  # imported from another copy (an installed one): forget it
        if loaded is not None and Path(loaded.__file__).resolve().parent != folder.resolve():
            for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
                del sys.modules[name]
    if "fxacct_cli" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fxacct_cli", cli_dir / "__init__.py",
                                                      submodule_search_locations=[str(cli_dir)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["fxacct_cli"] = package
        spec.loader.exec_module(package)
    main = importlib.import_module("fxacct_cli.main")
    for module, folder in ((main, cli_dir), (sys.modules["fxacct"], root / "fxacct")):
        if Path(module.__file__).resolve().parent != folder.resolve():
            raise RuntimeError(f"cli_reference hook: imported {module.__file__}, not from {folder}")
    return main.cli


def _sections(command, info_name: str, parent=None, depth: int = 0):
    """(depth, command path, help text) for the command and, for a group, each subcommand."""
    ctx = command.make_context(info_name, [], parent=parent, resilient_parsing=True, terminal_width=WIDTH)
    with ctx:
        yield depth, ctx.command_path, command.get_help(ctx)
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    yield from _sections(sub, name, ctx, depth + 1)


def render(root: Path) -> str:
    parts = []
    for depth, path, text in _sections(_load_cli(root), "fxacct"):
        level = 2 if depth <= 1 else 3  # fxacct and its commands at one level, `estimate`'s below
        parts.append(f"{'#' * level} `{path}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files, **kwargs):
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render(Path(config.config_file_path).parent))
