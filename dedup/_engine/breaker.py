"""A circuit breaker: when to stop calling Redis, and when to try it again.

Pure timing logic, no I/O: the Gateway reports each Redis call's outcome and
sends the half-open probe (a PING) itself. States:

- ``closed``: calls go to Redis. ``failures`` consecutive connection errors, or a
  single timeout (a call that already waited the whole ``redis_timeout_s``), open it.
- ``open``: calls skip Redis. After a cooldown (jittered, so that many gateways
  that opened together do not probe in lockstep) one probe may start.
- ``half_open``: one probe is in flight; every other call still skips Redis. Its
  success closes the circuit, its failure opens it again for another cooldown.

The clock and the random source are parameters, so tests drive it with a fake clock.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Literal

__all__ = ["BreakerState", "CircuitBreaker"]

BreakerState = Literal["closed", "open", "half_open"]
"""Where the breaker stands: ``closed`` (use Redis), ``open`` or ``half_open`` (skip it)."""


class CircuitBreaker:
    """Counts consecutive failures of a dependency and decides when to skip it.

    ``failures``: consecutive connection errors that open the circuit (a timeout
    opens it at once). ``cooldown_s``: how long it stays open before a probe;
    each cooldown is scaled by a random factor in ``[1 - jitter, 1 + jitter]``.
    ``clock`` returns seconds (monotonic); ``rand`` returns a float in ``[0, 1)``.
    """

    __slots__ = ("_clock", "_cooldown_s", "_due", "_failures", "_jitter", "_rand", "_state",
                 "_streak", "probes")  # fmt: skip

    def __init__(
        self,
        *,
        failures: int = 3,
        cooldown_s: float = 1.0,
        jitter: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if failures < 1:
            raise ValueError("failures must be at least 1")
        if not cooldown_s > 0:
            raise ValueError("cooldown_s must be positive")
        if not 0 <= jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        self._failures = failures
        self._cooldown_s = cooldown_s
        self._jitter = jitter
        self._clock = clock
        self._rand = rand
        self._state: BreakerState = "closed"
        self._streak = 0
        self._due = 0.0
        self.probes = 0
        """How many half-open probes were started."""

    @property
    def state(self) -> BreakerState:
        """The current state (see the module docstring)."""
        return self._state

    @property
    def closed(self) -> bool:
        """True when calls should go to the dependency."""
        return self._state == "closed"

    def success(self) -> None:
        """A call answered: the streak of failures is broken.

        Only the probe closes an open circuit: a late answer to a call sent before
        the circuit opened says little about the dependency now.
        """
        if self._state == "closed":
            self._streak = 0

    def failure(self, *, timeout: bool = False) -> bool:
        """A call failed (``timeout``: it waited for the full timeout); True if this opened
        the circuit. Failures while open or half-open change nothing: the probe decides."""
        if self._state != "closed":
            return False
        self._streak += 1
        if timeout or self._streak >= self._failures:
            self._open()
            return True
        return False

    def trip(self) -> None:
        """Open the circuit now, without failures counted (a dependency known to be
        down, as at a start without it)."""
        if self._state == "closed":
            self._open()

    def probe_delay_s(self) -> float:
        """Seconds until a probe may start (0 when one may start now, or when closed)."""
        if self._state != "open":
            return 0.0
        return max(0.0, self._due - self._clock())

    def try_probe(self) -> bool:
        """Start the probe if the cooldown is over and none is in flight: True if the
        caller must now probe and report with :meth:`probe_done`."""
        if self._state != "open" or self._clock() < self._due:
            return False
        self._state = "half_open"
        self.probes += 1
        return True

    def probe_done(self, ok: bool) -> None:
        """The probe's outcome: success closes the circuit, failure opens it again."""
        if self._state != "half_open":
            return
        if ok:
            self._state = "closed"
            self._streak = 0
        else:
            self._open()

    def _open(self) -> None:
        self._state = "open"
        self._streak = 0
        spread = 1 + self._jitter * (2 * self._rand() - 1)
        self._due = self._clock() + self._cooldown_s * spread
