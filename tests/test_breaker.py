"""The circuit breaker's timing logic, on a fake clock (no I/O in dedup._engine.breaker)."""

from __future__ import annotations

import pytest

from dedup._engine.breaker import CircuitBreaker


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def state(breaker: CircuitBreaker) -> str:
    """The state, unnarrowed (mypy would keep the literal of an earlier assert)."""
    return breaker.state


def make(clock: FakeClock, rand: float = 0.5, **kwargs: float) -> CircuitBreaker:
    return CircuitBreaker(clock=clock, rand=lambda: rand, **kwargs)  # type: ignore[arg-type]


def test_opens_after_consecutive_connection_errors_only() -> None:
    clock = FakeClock()
    breaker = make(clock, failures=3)
    assert breaker.closed and state(breaker) == "closed"
    assert breaker.failure() is False
    assert breaker.failure() is False
    breaker.success()  # the streak is broken
    assert breaker.failure() is False
    assert breaker.failure() is False
    assert breaker.closed
    opens = 0  # what the Gateway counts as stats.breaker_opens: failure() answering True
    assert breaker.failure() is True  # the third in a row
    opens += 1
    assert state(breaker) == "open" and not breaker.closed
    assert opens == 1
    opens += breaker.failure()
    assert opens == 1  # already open: nothing changes


def test_one_timeout_opens_at_once() -> None:
    breaker = make(FakeClock(), failures=5)
    assert breaker.failure(timeout=True) is True
    assert state(breaker) == "open"


def test_probe_after_cooldown_one_at_a_time_then_closes() -> None:
    clock = FakeClock()
    breaker = make(clock, failures=1, cooldown_s=2.0, rand=0.5)  # jitter factor exactly 1
    breaker.failure()
    assert breaker.probe_delay_s() == pytest.approx(2.0)
    assert breaker.try_probe() is False  # cooldown not over
    clock.advance(1.999)
    assert breaker.try_probe() is False
    clock.advance(0.002)
    assert breaker.probe_delay_s() == 0.0
    assert breaker.try_probe() is True
    assert state(breaker) == "half_open" and not breaker.closed
    assert breaker.try_probe() is False  # one probe at a time
    breaker.success()  # a late answer to an old call does not close it
    assert state(breaker) == "half_open"
    breaker.probe_done(True)
    assert breaker.closed and breaker.probes == 1
    # Closed again, the streak starts from zero.
    assert breaker.failure() is True  # a second opening (the Gateway counts 2)


def test_failed_probe_reopens_for_another_cooldown() -> None:
    clock = FakeClock()
    breaker = make(clock, failures=1, cooldown_s=1.0)
    opens = int(breaker.failure(timeout=True))
    clock.advance(1.0)
    assert breaker.try_probe()
    opens += breaker.failure()  # failures while half-open change nothing: the probe decides
    assert state(breaker) == "half_open"
    breaker.probe_done(False)
    assert state(breaker) == "open"
    assert opens == 1  # reopening after a probe is not a new outage
    assert breaker.probe_delay_s() == pytest.approx(1.0)
    assert not breaker.try_probe()
    clock.advance(1.0)
    assert breaker.try_probe()
    breaker.probe_done(True)
    assert breaker.closed


@pytest.mark.parametrize(("rand", "factor"), [(0.0, 0.8), (0.5, 1.0), (0.999999, 1.2)])
def test_cooldown_jitter_stays_within_bounds(rand: float, factor: float) -> None:
    breaker = make(FakeClock(), rand=rand, failures=1, cooldown_s=10.0, jitter=0.2)
    breaker.failure()
    assert breaker.probe_delay_s() == pytest.approx(10.0 * factor, abs=1e-4)


def test_probe_done_without_probe_and_delay_when_closed() -> None:
    breaker = make(FakeClock())
    breaker.probe_done(False)  # no probe in flight: ignored
    assert breaker.closed
    assert breaker.probe_delay_s() == 0.0
    assert breaker.try_probe() is False


@pytest.mark.parametrize(
    "kwargs", [{"failures": 0}, {"cooldown_s": 0.0}, {"jitter": 1.0}, {"jitter": -0.1}]
)
def test_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)  # type: ignore[arg-type]
