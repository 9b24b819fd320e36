"""protocol.fairness.lifted_counter, VTC's lift of a tenant that gets a request after having no
work backlogged: it never puts the tenant ahead of a backlogged tenant, never takes away
service it had, and with none backlogged starts it where the tenant served last is."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.fairness import lifted_counter

counter = st.floats(min_value=0.0, max_value=1e9, allow_nan=False)


@given(counter, st.lists(counter, min_size=1, max_size=8), st.none() | counter)
def test_a_returning_tenant_never_passes_a_backlogged_one(own: float, backlogged: list[float],
                                                          last_served: float | None) -> None:
    lifted = lifted_counter(own, backlogged, last_served)
    assert lifted >= own  # its own service is kept
    if lifted > own:  # lifted: to the least-served backlogged tenant, ahead of none of them
        assert lifted == min(backlogged)
        assert all(lifted <= c for c in backlogged)
    else:
        assert own >= min(backlogged)


@given(counter, st.none() | counter)
def test_with_none_backlogged_the_floor_is_the_tenant_served_last(
        own: float, last_served: float | None) -> None:
    expected = own if last_served is None else max(own, last_served)
    assert lifted_counter(own, [], last_served) == expected


def test_the_last_served_counter_counts_only_when_no_one_is_backlogged() -> None:
    assert lifted_counter(0.0, [5.0, 9.0], last_served=100.0) == 5.0
    assert lifted_counter(7.0, [5.0, 9.0], last_served=100.0) == 7.0
    assert lifted_counter(0.0, iter([]), last_served=100.0) == 100.0  # any iterable
    assert lifted_counter(3.0, [], last_served=None) == 3.0  # nothing served yet
