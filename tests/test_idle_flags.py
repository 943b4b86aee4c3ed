"""A flag that the rest of the command line leaves without effect is refused (exit 2, one line
naming it and what to do), as --microbatches without pp is, not accepted and ignored:
--gpus-per-node without --mesh, --pp-schedule without a pp dimension, --alloc-conf without --gpu,
--[no-]reshard-after-forward without fsdp, --no-max-batch without --gpu, --optim-arg with
--optimizer none.
Their defaults pass, and each passes where it has an effect (tests/test_interconnect_flag.py,
tests/test_parallel_pipeline.py, tests/test_reserved.py run them there)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fxacct.errors import UsageError
from fxacct.load.config import Config
from fxacct_cli.main import cli

MLP = ("examples/mlp.py:MLP", "-k", "d_model=64", "-k", "d_hidden=128", "-k", "n_blocks=2", "--batch", "2")


@pytest.mark.parametrize("command", ["profile", "check"])
@pytest.mark.parametrize("flags,says", [
    (["--gpus-per-node", "4"], "--gpus-per-node says how the ranks of a --mesh sit on nodes"),
    (["--pp-schedule", "gpipe"], "add one (e.g. --mesh pp=2) or drop --pp-schedule"),
    (["--mesh", "fsdp=2", "--pp-schedule", "interleaved-1f1b"], "(e.g. --mesh pp=2,fsdp=2) or drop --pp-schedule"),
    (["--alloc-conf", "expandable_segments:True"], "add --gpu NAME (e.g. --gpu h100) or drop --alloc-conf"),
    (["--no-reshard-after-forward"], "--mesh has no fsdp dimension: add one (e.g. --mesh fsdp=8) or drop "
                                     "--no-reshard-after-forward"),
    (["--mesh", "tp=2", "--reshard-after-forward"], "or drop --reshard-after-forward"),
    (["--no-max-batch"], "--no-max-batch skips the largest-batch search, which runs with --gpu only"),
    (["--optimizer", "none", "--optim-arg", "momentum=0.9"], "--optim-arg momentum with --optimizer none"),
])
def test_a_flag_without_effect_is_a_usage_error(command, flags, says):
    budget = ["--max-params", "1e9"] if command == "check" else []
    r = CliRunner().invoke(cli, [command, *MLP, *flags, *budget])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines


def test_their_defaults_and_a_mesh_that_uses_them_pass():
    """The defaults given explicitly by nobody pass on one device; --gpus-per-node with a --mesh and
    a --gpu (whose links it times the communication on) passes."""
    assert CliRunner().invoke(cli, ["check", *MLP, "--max-params", "1e9"]).exit_code == 0
    r = CliRunner().invoke(cli, ["check", *MLP, "--mesh", "fsdp=2", "--gpus-per-node", "2", "--gpu", "h100",
                                 "--no-max-batch", "--max-params", "1e9"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["check", *MLP, "--mesh", "fsdp=2", "--no-reshard-after-forward", "--gpu", "h100",
                                 "--no-max-batch", "--optimizer", "none"])
    assert r.exit_code == 0, r.output


def test_the_library_refuses_an_alloc_conf_without_a_gpu():
    with pytest.raises(UsageError, match="drop --alloc-conf"):
        Config(alloc_conf="expandable_segments:True")
    assert Config(alloc_conf="expandable_segments:True", gpu="h100").alloc_conf == "expandable_segments:True"
