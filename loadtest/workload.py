"""The workload both locustfiles share: Zipf-distributed values, settings from the environment,
and an optional record of what was answered (for the tests).

Settings (environment variables, read once at import):

- ``DEDUP_LOAD_VALUES`` (1,000,000): distinct values the stream draws from;
- ``DEDUP_LOAD_ZIPF`` (1.1): the Zipf exponent (0 is uniform);
- ``DEDUP_LOAD_BATCH`` (100): items per batch request of the batch users;
- ``DEDUP_LOAD_KIND`` ("load"): the kind of every item;
- ``DEDUP_LOAD_PREFIX`` ("v"): values are ``<prefix><rank>``; change it to start with
  values the table does not hold yet;
- ``DEDUP_LOAD_SINGLE_WEIGHT`` / ``DEDUP_LOAD_BATCH_WEIGHT`` (1 / 1): locust weights of the
  single-item and the batch user (0 leaves a user out);
- ``DEDUP_LOAD_SEED`` (unset): seed of the users' random streams, for repeatable runs;
- ``DEDUP_LOAD_RECORD`` (unset): a file to which each locust process appends, when it quits,
  one JSON line ``{"pid", "answered": [values...], "created": N}``; for the tests, which check
  the table against it.

This module is imported by the locustfiles (locust puts their folder on ``sys.path``); it
does not import dedup.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
from array import array
from typing import Any

from locust.user.task import LOCUST_STATE_STOPPING, LOCUST_STATE_WAITING

__all__ = [
    "BATCH",
    "BATCH_WEIGHT",
    "KIND",
    "PREFIX",
    "SINGLE_WEIGHT",
    "VALUES",
    "ZIPF",
    "GracefulStop",
    "Recorder",
    "ZipfValues",
    "env_float",
    "env_int",
    "recorder",
]


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer setting from the environment, with a clear error when it is not one."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        number = int(raw.replace("_", ""))
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not an integer") from None
    if number < minimum:
        raise SystemExit(f"{name} must be >= {minimum}, not {number}")
    return number


def env_float(name: str, default: float) -> float:
    """A float setting from the environment, with a clear error when it is not one."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number") from None


VALUES = env_int("DEDUP_LOAD_VALUES", 1_000_000, minimum=1)
ZIPF = env_float("DEDUP_LOAD_ZIPF", 1.1)
BATCH = env_int("DEDUP_LOAD_BATCH", 100, minimum=1)
KIND = os.environ.get("DEDUP_LOAD_KIND", "") or "load"
PREFIX = os.environ.get("DEDUP_LOAD_PREFIX", "v")
SINGLE_WEIGHT = env_int("DEDUP_LOAD_SINGLE_WEIGHT", 1)
BATCH_WEIGHT = env_int("DEDUP_LOAD_BATCH_WEIGHT", 1)
_SEED = os.environ.get("DEDUP_LOAD_SEED", "").strip()
_RECORD = os.environ.get("DEDUP_LOAD_RECORD", "").strip()


class ZipfValues:
    """Draws values ``<prefix><rank>`` with P(rank k) proportional to 1 / k**s, k = 1..n.

    The cumulative weights are built once per process (an ``array`` of doubles: 8 MB for
    a million values) and shared by every user; each user draws with its own ``Random``.
    """

    _cum: array[float] | None = None
    _cum_key: tuple[int, float] = (0, 0.0)
    _lock = threading.Lock()
    _seeds = itertools.count()

    def __init__(self, n: int = VALUES, s: float = ZIPF, prefix: str = PREFIX) -> None:
        if s < 0:
            raise SystemExit("DEDUP_LOAD_ZIPF must be >= 0 (0 is uniform)")
        self.n = n
        self.prefix = prefix
        self._ranks = range(n)
        self._weights = self._cumulative(n, s)
        seed = None if not _SEED else f"{_SEED}-{next(self._seeds)}"
        self._random = random.Random(seed)

    @classmethod
    def _cumulative(cls, n: int, s: float) -> array[float]:
        with cls._lock:
            if cls._cum is None or cls._cum_key != (n, s):
                cls._cum = array("d", itertools.accumulate(1.0 / k**s for k in range(1, n + 1)))
                cls._cum_key = (n, s)
            return cls._cum

    def draw(self, k: int) -> list[str]:
        """``k`` values (with repeats, as the distribution gives them)."""
        prefix = self.prefix
        ranks = self._random.choices(self._ranks, cum_weights=self._weights, k=k)
        return [f"{prefix}{r}" for r in ranks]

    def one(self) -> str:
        """One value."""
        return self.draw(1)[0]


class GracefulStop:
    """Mixin for a User: stop between two requests, never in the middle of one.

    locust kills a user at once when it is "waiting" as the run stops; with no wait time
    that kill (thrown into the greenlet by a later callback) lands after the user has woken
    up and sent its next request, so the request is abandoned: its row gets written but
    its answer is never counted. Here a waiting user is marked "stopping" instead, so it
    leaves at its next wait (within ``--stop-timeout``). With ``--stop-timeout 0`` locust
    forces the stop and this changes nothing.
    """

    _state: str | None

    def stop(self, force: bool = False) -> Any:
        """locust's ``User.stop``, with a waiting user left to finish as a running one."""
        if not force and self._state == LOCUST_STATE_WAITING:
            self._state = LOCUST_STATE_STOPPING
            return False
        return super().stop(force)  # type: ignore[misc]


class Recorder:
    """What this process got answered: the values, and how many answers said ``created``.

    Off (no cost) unless ``DEDUP_LOAD_RECORD`` names a file; :meth:`flush` appends one JSON
    line to it in a single ``write`` (O_APPEND), so several processes can share the file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.enabled = bool(path)
        self.answered: set[str] = set()
        self.created = 0
        self._flushed = False

    def add(self, value: str, created: bool) -> None:
        """Note one answered value."""
        if self.enabled:
            self.answered.add(value)
            self.created += created

    def flush(self) -> None:
        """Append this process's record to the file (once)."""
        if not self.enabled or self._flushed:
            return
        self._flushed = True
        line = json.dumps(
            {"pid": os.getpid(), "answered": sorted(self.answered), "created": self.created}
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


recorder = Recorder(_RECORD)
