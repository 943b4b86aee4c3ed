"""The CLI answers --help, --version and usage errors before torch, transformers or networkx are
imported (issue 25, item 1). Structural, not timed: a fresh interpreter runs each command line
through the CLI's entry point and reports its exit code, its stderr and which of those packages are
in ``sys.modules`` at that point; bench/speed.py times the same lines."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from fxacct.dtypes import TORCH_NAMES
from fxacct.load.config import Config
from fxacct.load.flags import DEFAULTS

HEAVY = ("torch", "transformers", "networkx")

# one interpreter runs the lines in order; each reports what was imported after it ran, so the
# first line that imports torch is named even though the ones after it would inherit torch
CHILD = r"""
import contextlib, io, json, sys
from fxacct_cli.main import run
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    sys.argv = ["fxacct", *args]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run()  # main() without its os._exit
    print(json.dumps({"args": args, "code": code, "stderr": err.getvalue(),
                      "loaded": [m for m in HEAVY if m in sys.modules]}))
""".replace("HEAVY", repr(HEAVY))

MLP = "examples/mlp.py:MLP"
# (command line, exit code, what the one line of stderr says)
LINES = [
    (["--help"], 0, None),
    (["--version"], 0, None),
    (["profile", "--help"], 0, None),
    (["check", "--help"], 0, None),
    (["profile", "nope.py:M"], 2, "model file 'nope.py' not found"),
    (["profile", "nope:"], 2, "malformed model 'nope:'"),
    (["profile", MLP, "-k", "foo"], 2, "malformed -k 'foo'"),
    (["profile", MLP, "-o", "/nonexistent-dir/x.json"], 2, "directory /nonexistent-dir does not exist"),
    (["profile", MLP, "--mesh", "fsdp=x"], 2, "--mesh 'fsdp=x'"),
    (["profile", MLP, "--dtype", "bf17"], 2, "unknown dtype 'bf17'"),
    (["profile", MLP, "--amp", "fp17"], 2, "unknown dtype 'fp17'"),
    (["profile", MLP, "--gpu", "h900"], 2, "unknown --gpu 'h900'"),
    (["profile", "hf:/nonexistent-dir"], 2, "no Hugging Face config at '/nonexistent-dir'"),
    (["profile", MLP, "--format", "yaml"], 2, "'yaml' is not one of"),
    (["check", "nope.py:M", "--max-params", "7B"], 2, "model file 'nope.py' not found"),
    (["check", MLP, "--max-params", "seven"], 2, "--max-params 'seven' is not a count"),
    (["diff", "nope-a.json", "nope-b.json"], 2, "nope-a.json"),
]


def _run(lines: list[list[str]]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(lines)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_help_version_and_usage_errors_answer_before_torch():
    reports = _run([args for args, _, _ in LINES])
    assert len(reports) == len(LINES)
    for (args, code, message), report in zip(LINES, reports):
        assert report["loaded"] == [], f"{args} imported {report['loaded']} before answering"
        assert report["code"] in (code, None if code == 0 else code), report
        if message is not None:
            lines = report["stderr"].splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], report


def test_the_probe_sees_torch_when_a_check_needs_it():
    # the control: --batch 0 is refused by Config, which imports torch; a probe that could not see
    # torch in sys.modules would pass the test above whatever the CLI imports
    (report,) = _run([["profile", MLP, "--batch", "0"]])
    assert report["code"] == 2 and "--batch must be a positive integer" in report["stderr"], report
    assert "torch" in report["loaded"], report


def test_dtype_names_known_without_torch_are_torchs():
    assert {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)} == TORCH_NAMES


def test_the_defaults_the_help_shows_are_configs():
    config = Config()
    for field in dataclasses.fields(DEFAULTS):
        assert getattr(DEFAULTS, field.name) == getattr(config, field.name), field.name


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("torch.float8_e5m2", torch.float8_e5m2),
                                        ("FP32", torch.float32), ("long", torch.int64), ("cfloat", torch.complex64)])
def test_parse_dtype_still_gives_torch_dtypes(name, dtype):
    from fxacct.dtypes import parse_dtype

    assert parse_dtype(name) is dtype


def test_the_console_script_flushes_its_output_and_keeps_the_exit_code():
    """main() leaves through os._exit (no interpreter teardown): what a command printed to a pipe
    arrives whole, and the exit code is the command's."""
    done = subprocess.run([sys.executable, "-m", "fxacct_cli", "profile", MLP, "--format", "json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["model_class"] == "MLP"
    done = subprocess.run([sys.executable, "-m", "fxacct_cli", "profile", "nope.py:M"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "nope.py" in done.stderr, done.stderr


def test_exit_code_reads_system_exit_as_the_interpreter_does(capsys):
    from fxacct_cli.main import exit_code

    assert (exit_code(None), exit_code(0), exit_code(3)) == (0, 0, 3)
    assert exit_code("stopped: reason") == 1 and capsys.readouterr().err == "stopped: reason\n"
