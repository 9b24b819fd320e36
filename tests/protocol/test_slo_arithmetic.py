"""The SLO arithmetic against cases worked by hand: attainment, error budget left, burn rates
over both windows, and the state they add up to."""

from __future__ import annotations

import pytest

from protocol.measures import attainment, budget_left, slo_state
from tenants.slo_views import tenant_slo


def test_attainment_budget_and_burn_by_hand() -> None:
    # 1000 requests, 995 met: 0.995 attained; the budget is 1% = 10 misses, 5 spent: half left;
    # a burn rate of 0.5 (misses at half the rate the budget allows)
    assert attainment(995, 1000)["fraction"] == pytest.approx(0.995)
    assert attainment(995, 1000)["burn_rate"] == pytest.approx(0.5)
    assert budget_left(995, 1000) == pytest.approx(0.5)
    # 20 misses of 1000: twice the budget: burn 2x, budget overspent by a whole budget
    assert attainment(980, 1000)["burn_rate"] == pytest.approx(2.0)
    assert budget_left(980, 1000) == pytest.approx(-1.0)
    # exactly on target: budget spent to zero, burn 1x
    assert budget_left(990, 1000) == pytest.approx(0.0)
    assert attainment(990, 1000)["burn_rate"] == pytest.approx(1.0)
    # a 99.9% target: 1 miss in 1000 spends it all
    assert budget_left(999, 1000, target=0.999) == pytest.approx(0.0)
    assert budget_left(0, 0) is None and attainment(0, 0)["burn_rate"] is None
    with pytest.raises(ValueError):
        budget_left(11, 10)


def test_the_state_follows_the_workbooks_paging_rates() -> None:
    assert slo_state(0.9, 0.5, 0.5) == "ok"
    assert slo_state(0.9, 1.5, 0.5) == "at_risk"  # faster than the budget allows
    assert slo_state(0.2, 0.1, 0.1) == "at_risk"  # under a quarter of the budget left
    assert slo_state(0.9, 14.4, 0.5) == "breaching"  # 14.4x over 1 h: a page
    assert slo_state(0.9, 2.0, 6.0) == "breaching"  # 6x over 6 h: a page
    assert slo_state(0.0, 0.1, 0.1) == "breaching"  # the month's budget is spent
    assert slo_state(None, None, None) == "no_data"


def test_a_tenants_periods_by_hand() -> None:
    """Requests: 1 h: 200 checked, 6 missed (burn 3x); 6 h: 1200 checked, 12 missed (1x); 30 d:
    50,000 checked, 250 missed: budget 500, half left; 24 h: 10,000 checked, 100 missed. Gaps
    (ITL): 1 h: 10,000, 50 missed (0.5x); 30 d: 1,000,000, 2,500 missed: three quarters left."""
    counts = {"1h": {"slo_checked": 200, "slo_met": 194, "ttft_checked": 200, "ttft_met": 195,
                     "tpot_checked": 200, "tpot_met": 199, "itl_gaps": 10_000,
                     "itl_gaps_met": 9_950},
              "6h": {"slo_checked": 1200, "slo_met": 1188, "itl_gaps": 60_000,
                     "itl_gaps_met": 59_700},
              "24h": {"slo_checked": 10_000, "slo_met": 9_900},
              "30d": {"slo_checked": 50_000, "slo_met": 49_750, "itl_gaps": 1_000_000,
                      "itl_gaps_met": 997_500}}
    figures = tenant_slo(counts)
    assert figures["attainment"]["1h"] == pytest.approx(0.97)
    assert figures["ttft_attainment"]["1h"] == pytest.approx(0.975)
    assert figures["tpot_attainment"]["1h"] == pytest.approx(0.995)
    assert figures["itl_attainment"]["1h"] == pytest.approx(0.995)  # of gaps, not requests
    assert figures["itl_attainment"]["30d"] == pytest.approx(0.9975)
    assert figures["attainment"]["24h"] == pytest.approx(0.99)
    assert figures["attainment"]["30d"] == pytest.approx(0.995)
    assert figures["burn_rate"]["1h"] == pytest.approx(3.0)
    assert figures["burn_rate"]["6h"] == pytest.approx(1.0)
    assert figures["budget_left_30d"] == pytest.approx(0.5)
    assert (figures["checked_30d"], figures["missed_30d"]) == (50_000, 250)
    assert figures["itl_burn_rate"]["1h"] == pytest.approx(0.5)
    assert figures["itl_budget_left_30d"] == pytest.approx(0.75)
    assert (figures["itl_gaps_30d"], figures["itl_missed_30d"]) == (1_000_000, 2_500)
    assert figures["state"] == "at_risk"  # burning at 3x over the last hour


def test_the_state_is_the_worse_of_the_requests_and_the_gaps() -> None:
    """Every request within TTFT and TPOT, but a fifth of the gaps over the ITL target: the
    gaps' budget is gone, so the tenant breaches; without ITL counts the gaps have no say."""
    quiet = {p: {"slo_checked": 100, "slo_met": 100} for p in ("1h", "6h", "24h", "30d")}
    assert tenant_slo(quiet)["state"] == "ok"
    assert tenant_slo(quiet)["itl_attainment"]["1h"] is None
    stalled = {p: {**c, "itl_gaps": 1000, "itl_gaps_met": 800} for p, c in quiet.items()}
    figures = tenant_slo(stalled)
    assert figures["attainment"]["1h"] == 1.0 and figures["burn_rate"]["1h"] == 0.0
    assert figures["itl_burn_rate"]["1h"] == pytest.approx(20.0)
    assert figures["state"] == "breaching"
    gaps_only = {p: {"itl_gaps": 1000, "itl_gaps_met": 1000} for p in quiet}
    assert tenant_slo(gaps_only)["state"] == "ok"  # no request checked: the gaps still say
    assert tenant_slo({})["state"] == "no_data"
