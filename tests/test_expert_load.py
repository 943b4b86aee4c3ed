"""--expert-load's histogram (fxacct.load.expert_load): reading, the busiest rank, whole-row splits,
worked by hand; the account it drives is checked in tests/test_torchtitan.py."""

from __future__ import annotations

import json

import pytest
from helpers import assert_one_line_exit_2, invoke_profile

from fxacct.errors import UsageError
from fxacct.load.expert_load import ExpertLoad, Routing, apportion, busiest_rank, read


def _file(tmp_path, doc) -> str:
    path = tmp_path / "load.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_apportion_gives_whole_rows_by_largest_remainder():
    assert apportion(10, [0.25] * 4) == [3, 3, 2, 2]  # 2.5 each: the remainder to the first ranks
    assert apportion(100, [0.5, 0.3, 0.2]) == [50, 30, 20]
    assert apportion(7, [0.6, 0.4]) == [4, 3]  # 4.2 and 2.8: floors 4 and 2, the one left to 0.8
    assert sum(apportion(1023, [0.1, 0.2, 0.3, 0.4])) == 1023


def test_balanced_routing_is_an_equal_share_with_the_remainder_first():
    send, recv = Routing().splits(object(), 10, 4)
    assert send == recv == [3, 3, 2, 2]


def test_the_busiest_rank_is_accounted_as_rank_zero():
    """8 experts on 4 ranks (2 each), 16 tokens: rank 2's experts (4 and 5) get 8, rank 3's 4,
    ranks 0 and 1 2 each. Rank 2 is the busiest; rotated onto rank 0 (the order 2, 3, 0, 1) it
    splits R = 100 rows 50, 25, 12.5, 12.5: whole rows 50, 25, 13, 12 (the half row to the first
    of the tied), and receives from each of the 4 ranks the 50 rows its experts get."""
    load = ExpertLoad("h.json", ((1, 1, 1, 1, 4, 4, 2, 2),))
    assert busiest_rank(load, 4) == 2
    assert Routing(load).splits(object(), 100, 4) == ([50, 25, 13, 12], [50] * 4)


def test_per_layer_histograms_number_the_layers_by_first_call():
    load = ExpertLoad("h.json", ((1, 1, 1, 1), (3, 1, 0, 0)))
    routing, first, second = Routing(load), object(), object()
    # rank 0's shares: 1/2 in layer 0, 1 in layer 1; rank 1's 1/2 and 0: rank 0 is the busiest
    assert routing.splits(first, 8, 2) == ([4, 4], [4, 4])
    assert routing.splits(second, 8, 2) == ([8, 0], [8, 8])
    assert routing.splits(first, 8, 2) == ([4, 4], [4, 4])  # its recompute: the same layer
    with pytest.raises(UsageError, match="2 histograms, but the model routes through more MoE layers"):
        routing.splits(object(), 8, 2)


@pytest.mark.parametrize("doc, needle", [
    ("{not json", "not JSON"),
    ({"tokens": [1, 2]}, "expected {\"experts\""),
    ({"experts": [1, -2]}, "finite and >= 0"),
    ({"experts": [0, 0]}, "routes no tokens"),
    ({"layers": [[1, 2], "x"]}, "(layer 1): each histogram"),
    ({"experts": [1, True]}, "finite and >= 0"),
])
def test_a_bad_file_is_a_usage_error(tmp_path, doc, needle):
    with pytest.raises(UsageError) as e:
        read(_file(tmp_path, doc))
    assert needle in str(e.value)


def test_reads_counts_and_fractions(tmp_path):
    assert read(_file(tmp_path, {"experts": [1, 2.5]})).layers == ((1.0, 2.5),)
    assert read(_file(tmp_path, {"layers": [[1], [2]]})).of_layer(1) == (2.0,)


@pytest.mark.parametrize("args, needle", [
    # fxacct's own engine builds no experts: refused on one device and under --mesh alike
    (["examples/mlp.py:MLP", "--expert-load", "tests/data/expert_load_63.json"], "torchtitan:MODULE:CONFIG MoE targets"),
    (["examples/mlp.py:MLP", "--mesh", "fsdp=1", "--expert-load", "tests/data/expert_load_63.json"],
     "torchtitan:MODULE:CONFIG MoE targets"),
])
def test_expert_load_without_torchtitan_experts_is_one_line(args, needle):
    assert_one_line_exit_2(invoke_profile(*args), needle)
