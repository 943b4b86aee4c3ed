"""One way to print a duration (fxacct.report.durations): the unit is picked after rounding to the 3
significant digits shown, so a value just below a unit's end reads as the next unit's 1, never as
"1e+03" of the smaller one (the check table printed --max-step-time 999.9us as "1e+03 µs")."""

import pytest

from fxacct.report.durations import format_ms, format_seconds


@pytest.mark.parametrize("seconds,text", [
    (44.1, "44.1 s"),  # the docstring's: a step of 44,100 ms
    (0.00481e-6, "4.81 ns"),  # a loss of 0.00481 µs
    (0.0238 * 86_400, "34.3 min"),  # 0.0238 days
    (999.9e-6, "1 ms"), (999.4e-6, "999 µs"), (1e-3, "1 ms"),
    (59.99, "1 min"), (59.94, "59.9 s"),
    (0.5e-9, "0.5 ns"), (0, "0 s"), (None, "-"),
])
def test_the_unit_is_chosen_after_rounding(seconds, text):
    assert format_seconds(seconds) == text


def test_milliseconds_read_the_same():
    assert format_ms(999.9e-3) == "1 ms" and format_ms(1500) == "1.5 s"
