"""fxacct.report.plot: the memory timeline data and the PNG."""

import sys

import pytest

import fxacct
from fxacct.memory.peak import CATEGORIES
from fxacct.report.plot import memory_timeline, plot_memory
from helpers import config, target


@pytest.fixture(scope="module")
def mlp_profile():
    return fxacct.profile(fxacct.Config(target=target("examples/mlp.py:MLP"), batch=2))


def test_timeline_peak_is_the_training_peak(mlp_profile):
    timeline = memory_timeline(mlp_profile)
    assert all(set(live) == set(CATEGORIES) for _, _, live in timeline)
    assert {phase for _, phase, _ in timeline} >= {"forward", "loss", "backward", "optimizer"}
    assert max(sum(live.values()) for _, _, live in timeline) == mlp_profile.memory.peak_train.bytes


def test_sharded_timeline_is_per_rank():
    p = fxacct.profile(config("MLP", batch=2, world_size=4, shard="zero3"))
    timeline = memory_timeline(p)
    assert max(sum(live.values()) for _, _, live in timeline) == p.memory.per_rank.bytes
    assert p.memory.per_rank.bytes < p.memory.peak_train.bytes


def test_png_written(mlp_profile, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "memory.png"
    plot_memory(mlp_profile, str(out))
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert [f.name for f in tmp_path.iterdir()] == ["memory.png"]  # no temporary file left behind


def test_missing_matplotlib_is_a_usage_error(mlp_profile, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(fxacct.UsageError, match=r"pip install 'fxacct\[plot\]'") as e:
        plot_memory(mlp_profile, str(tmp_path / "memory.png"))
    assert e.value.exit_code == 2
    assert not any(tmp_path.iterdir())
