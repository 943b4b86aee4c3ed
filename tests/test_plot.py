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


def test_a_one_op_spike_at_a_phase_boundary_is_drawn_over_the_boundary():
    # Five ops, the peak a single op (index 2) right after the forward→backward boundary at x = 1.5:
    # the stack is drawn in steps one op wide (so the spike is a column from x 1.5 to 2.5 at full
    # height), the boundary line lies behind the stack, and the peak marker above everything.
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from fxacct.report.plot import draw_timeline
    from fxacct.units import GiB

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    phases = ["forward", "forward", "backward", "backward", "backward"]
    stacks = [[0] * 5 for _ in CATEGORIES]
    stacks[0] = [GiB, GiB, GiB, GiB, GiB]  # 1 GiB resident throughout
    stacks[-1] = [0, 0, 3 * GiB, 0, 0]  # + 3 GiB for one op: a 4 GiB peak at op 2
    artists = draw_timeline(ax, [f"op{i}" for i in range(5)], phases, stacks)
    assert artists["peak_index"] == 2
    [boundary] = artists["boundaries"]
    assert boundary.get_xdata()[0] == 1.5
    top = artists["stack"][-1]
    assert boundary.get_zorder() < top.get_zorder() < min(a.get_zorder() for a in artists["peak"])
    at_peak = [x for path in top.get_paths() for x, y in path.vertices if y == pytest.approx(4.0)]
    assert min(at_peak) <= 1.5 and max(at_peak) >= 2.5, at_peak  # one full op wide
    stem, marker = artists["peak"]
    [[(x0, y0), (x1, y1)]] = stem.get_segments()
    assert (x0, x1, y0, y1) == (2, 2, 0, 4.0)
    assert list(marker.get_xdata()) == [2] and list(marker.get_ydata()) == [4.0]
