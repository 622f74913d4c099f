"""Pure: how many requests the runner keeps in flight (`capacity`)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_farm.batch.capacity import (
    DEFAULT_MAX_RUNNING,
    MIN_SHARE,
    Throttle,
    WorkerSlots,
    slots,
    target,
    workers_from_status,
)


def w(
    i: int, state: str = "ready", *, routed: bool = True, q: bool = False, n: int = 72
) -> WorkerSlots:
    return WorkerSlots(i, state, routed, q, n)


def test_slots_are_the_serving_workers_max_running_requests() -> None:
    farm = [w(i) for i in range(8)]
    assert slots(farm, gateway=True, held_out=False) == 8 * 72


def test_slots_shrink_on_quarantine_drain_and_restart_and_come_back() -> None:
    farm = [w(0), w(1, q=True), w(2, "draining"), w(3, "starting"), w(4, routed=False), w(5)]
    assert slots(farm, gateway=True, held_out=False) == 2 * 72
    # without a gateway, "in the gateway" means nothing
    assert slots(farm, gateway=False, held_out=False) == 3 * 72
    assert slots([w(i) for i in range(6)], gateway=True, held_out=False) == 6 * 72


def test_a_host_held_out_of_the_gateway_serves_nothing() -> None:
    assert slots([w(0)], gateway=True, held_out=True) == 0


def test_the_agents_status_is_read_as_it_is_answered() -> None:
    status = {
        "workers": [
            {"id": 0, "state": "ready", "in_gateway": True, "quarantine": None},
            {"id": 1, "state": "ready", "in_gateway": True, "quarantine": {"gpu": 1}},
            {"id": 2, "state": "stopped", "in_gateway": False, "quarantine": None},
        ],
        "gateway": {"url": "http://x"},
        "held_out_since": 123.0,
    }
    workers, gateway, held = workers_from_status(status, {0: 64})
    assert [(x.id, x.state, x.quarantined, x.max_running) for x in workers] == [
        (0, "ready", False, 64),
        (1, "ready", True, DEFAULT_MAX_RUNNING),
        (2, "stopped", False, DEFAULT_MAX_RUNNING),
    ]
    assert gateway and held
    assert workers_from_status({"workers": "junk"}, {}) == ([], False, False)


def test_overload_halves_at_most_once_a_second_and_grows_back() -> None:
    t = Throttle().overload(10.0)
    assert t.share == 0.5
    assert t.overload(10.5).share == 0.5
    t = t.overload(11.0)
    assert t.share == 0.25
    grown = t.ok(12.0).ok(17.0)
    assert abs(grown.share - (0.25 + 0.05 * 6)) < 1e-9  # 0.05 a second since the cut
    assert grown.ok(100.0).share == 1.0


def test_the_target_is_capped_and_never_zero_while_a_slot_serves() -> None:
    assert target(576, Throttle(), None) == 576
    assert target(576, Throttle(), 100) == 100
    assert target(2, Throttle(share=MIN_SHARE), None) == 1
    assert target(0, Throttle(), 10) == 0


@settings(max_examples=300, database=None)
@given(st.floats(0, 1000), st.lists(st.floats(0, 5), max_size=50))
def test_the_share_stays_between_its_floor_and_one(start: float, gaps: list[float]) -> None:
    t = Throttle()
    now = start
    for i, gap in enumerate(gaps):
        now += gap
        t = t.overload(now) if i % 3 == 0 else t.ok(now)
        assert MIN_SHARE <= t.share <= 1.0
