import time

import pytest

from autoscale.errors import BudgetError
from autoscale.search.budget import Budget, Ledger, format_duration, parse_budget, process_elapsed


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1h5m30s", 3930),
        ("0.5h", 1800),
        (" 2M ", 120),
    ],
)
def test_parse_budget_accepts_the_documented_forms(text, seconds):
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["90", "5x", "m", "", "30m1h", "1h-5m", "0s", "two hours"])
def test_parse_budget_refuses_anything_else_naming_value_and_forms(text):
    with pytest.raises(BudgetError) as info:
        parse_budget(text)
    msg = str(info.value)
    assert f"'{text}'" in msg and "90s, 30m, 2h or 1h30m" in msg and "\n" not in msg


def test_format_duration_round_trips_through_parse_budget():
    for seconds in (45, 60, 90, 3600, 5400, 3725):
        assert parse_budget(format_duration(seconds)) == seconds
    assert format_duration(4.25) == "4.2s"


def test_budget_counts_from_process_start_and_keeps_a_reserve():
    b = Budget.from_process_start(60)
    assert 0 < b.elapsed() == pytest.approx(process_elapsed(), abs=0.5)
    assert b.reserve == 3.0  # 4% of 60 s is below the 3 s floor
    assert b.end == pytest.approx(b.start + 57)
    assert Budget.from_process_start(7200).reserve == 60.0  # 4% capped at a minute
    assert b.left() == pytest.approx(b.end - time.monotonic(), abs=0.05)


def test_ledger_sums_categories_by_prefix():
    ledger = Ledger()
    with ledger.track("work:replay"):
        time.sleep(0.01)
    ledger.add("bk:notes", 0.5)
    ledger.add("bk:plots", 0.25)
    assert ledger.total("bk:") == 0.75
    assert 0.01 <= ledger.total("work:") < 0.5
