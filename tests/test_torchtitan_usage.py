"""torchtitan targets' usage errors that need no torchtitan: each a one-line exit 2."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner
from helpers import assert_one_line_exit_2, invoke_profile, target

from fxacct_cli.main import cli

LLAMA = target("examples/llama.py:Llama")


_invoke = invoke_profile


def test_without_torchtitan_installed(monkeypatch):
    """sys.modules[name] = None makes `import torchtitan` raise ModuleNotFoundError, as on a machine
    without it; the error names the extra that installs it."""
    monkeypatch.setitem(sys.modules, "torchtitan", None)
    r = _invoke("torchtitan:llama3:llama3_debugmodel", "--mesh", "fsdp=2")
    assert_one_line_exit_2(r, "pip install 'fxacct[torchtitan]'")


@pytest.mark.parametrize("args, needle", [
    (["torchtitan:llama3"], "torchtitan:MODULE:CONFIG"),
    ([LLAMA, "--mesh", "fsdp=2,cp=2"], "profile a torchtitan:MODULE:CONFIG target"),
    ([LLAMA, "--mesh", "fsdp=2,ep=2"], "profile a torchtitan:MODULE:CONFIG target"),
    ([LLAMA, "--", "--training.steps", "3"], "for torchtitan:MODULE:CONFIG targets only"),
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "tp=2,fsdp=2"], "outer to inner"),
    # flags whose part of the job torchtitan's config decides are refused, not ignored
    (["torchtitan:llama3:llama3_debugmodel", "--dtype", "bf16"], "--dtype with a torchtitan target"),
    (["torchtitan:llama3:llama3_debugmodel", "--optimizer", "sgd"], "--optimizer with a torchtitan target"),
    (["torchtitan:llama3:llama3_debugmodel", "--checkpoint", "layers.*"], "activation-checkpoint:full"),
    (["torchtitan:llama3:llama3_debugmodel", "--runtime"], "--runtime with a torchtitan target"),
])
def test_usage_errors_are_one_line(args, needle):
    assert_one_line_exit_2(_invoke(*args), needle)


def test_plan_without_torchtitan_installed(monkeypatch):
    """fxacct plan takes torchtitan targets too: without torchtitan, the same one line as profile."""
    monkeypatch.setitem(sys.modules, "torchtitan", None)
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    r = runner.invoke(cli, ["plan", "torchtitan:llama3:llama3_8b", "--gpus", "8", "--gpu", "h100", "--global-batch", "8"],
                      catch_exceptions=False)
    assert_one_line_exit_2(r, "pip install 'fxacct[torchtitan]'")


def test_ep_does_not_multiply_the_world():
    """torchtitan carves ep out of the fsdp x cp x tp ranks (parallel_dims.py::build_mesh: efsdp =
    fsdp x tp / ep): fsdp=4,ep=4 is 4 ranks, not 16."""
    from fxacct.load.mesh import parse_mesh

    assert parse_mesh("fsdp=4,ep=4").world_size == 4
    assert parse_mesh("pp=2,fsdp=2,cp=2,tp=2").world_size == 16
