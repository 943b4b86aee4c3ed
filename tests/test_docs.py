"""The README stays a newcomer's page and the documentation site builds.

- README.md is under 250 lines and holds the two commands verbatim: the one that installs and
  profiles the shipped GPT-2, and the test command exactly as `.ci/run` runs it.
- Every relative link in README.md and docs/*.md points to a file that exists.
- `mkdocs build --strict` succeeds (broken links and anchors inside docs/ fail it); the CLI
  reference page is generated at build time by docs/hooks/cli_reference.py from the Click commands.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

PROFILE_COMMAND = "pip install torch==2.13.0 -e . && fxacct profile examples/gpt2.py:GPT --batch 8 --dtype bf16"
README_TORCH = re.search(r"torch==(\S+)", PROFILE_COMMAND)[1]  # the torch the README installs
MAX_README_LINES = 250

def _ci_test_command() -> str:
    """The line of .ci/run that installs the test extras and runs pytest."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    found = [line for line in lines if line.startswith("pip install") and "pytest" in line]
    assert len(found) == 1, f".ci/run should hold one 'pip install ... pytest' line, found {found}"
    return found[0]


def test_readme_is_short_and_holds_the_two_commands():
    text = README.read_text()
    n = len(text.splitlines())
    assert n < MAX_README_LINES, f"README.md has {n} lines; keep it under {MAX_README_LINES} (move detail to docs/)"
    readme_lines = [line.strip() for line in text.splitlines()]
    assert PROFILE_COMMAND in readme_lines, f"README.md lost the first command, on a line of its own: {PROFILE_COMMAND}"
    test_command = _ci_test_command()
    assert test_command in readme_lines, f"README.md must hold .ci/run's test command verbatim: {test_command}"


def _strip_code(text: str) -> str:
    """Markdown without fenced code blocks and inline code, where a bracket is no link."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _relative_links(path: Path) -> list[str]:
    links = []
    for target in LINK.findall(_strip_code(path.read_text())):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto:, or an anchor in the same page
        links.append(target)
    return links


MARKDOWN_FILES = [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(path):
    missing = []
    for target in _relative_links(path):
        file = (path.parent / target.split("#", 1)[0]).resolve()
        if not file.exists():
            missing.append(target)
        elif ROOT not in file.parents:
            missing.append(f"{target} (outside the repository)")
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files: {missing}"


def test_readme_links_into_docs():
    links = _relative_links(README)
    for page in ("docs/guide.md", "docs/parallel.md", "docs/json.md", "docs/conventions.md", "docs/cli.md"):
        assert page in links, f"README.md should link to {page}"


@pytest.mark.slow  # a whole mkdocs build
def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install mkdocs mkdocs-material): the site build is not checked")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    reference = (tmp_path / "site" / "cli" / "index.html").read_text()
    for command in ("fxacct profile", "fxacct check", "fxacct diff", "fxacct estimate train-time",
                    "fxacct plan", "fxacct calibrate"):
        assert f"Usage: {command}" in reference, f"the CLI reference lacks {command}'s --help"
    assert "<!-- cli-reference -->" not in reference, "the hook left its marker in the CLI reference"


def _shown_block(path: Path, command: str) -> list[str]:
    """The lines a doc shows under ``$ {command}`` in its code block, up to the block's end."""
    lines = path.read_text().splitlines()
    start = lines.index(f"$ {command}")
    return lines[start + 1:lines.index("```", start)]


def _printed(command: str, columns: int | None = None) -> list[str]:
    """What `fxacct ...` prints into a pipe (no width limit), or fitted to ``columns``, run as a user runs it.
    The docs show what the README's torch prints (op counts move with torch's decompositions)."""
    if not importlib.metadata.version("torch").startswith(README_TORCH):
        pytest.skip(f"the docs show what torch {README_TORCH} prints")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": str(columns)} if columns else {})
    result = subprocess.run([sys.executable, "-m", "fxacct_cli", *command.split()[1:]], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_guides_first_profile_is_what_the_command_prints():
    """docs/guide.md's first profile, whole: it had drifted (the config line had lost its loss, the
    op count was two nodes out) with nothing to say so."""
    command = "fxacct profile examples/two_layer.py:TwoLayer --batch 2"
    assert _shown_block(DOCS / "guide.md", command) == _printed(command)


@pytest.mark.slow
def test_the_readmes_profile_lines_are_what_the_command_prints():
    """README.md's GPT-2 profile is trimmed ('...' stands for what is left out); every line it shows
    is one the command prints (its config line and op count had drifted)."""
    command = "fxacct profile examples/gpt2.py:GPT --batch 8 --dtype bf16"
    printed = set(_printed(command, columns=100))  # the README's block is fitted to 100 columns
    shown = [line for line in _shown_block(README, command) if line != "..."]
    assert shown and [line for line in shown if line not in printed] == []
