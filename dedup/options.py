"""The Gateway's options in one place: every default, its validation and the derived values.

:class:`GatewayOptions` is what ``Gateway(**options)`` builds first. The command
line and the service build it too (from :class:`dedup.service.settings.Settings`), so one
set of checks refuses a bad option everywhere, with :class:`~dedup.errors.ConfigError`,
before any I/O.

Each default is written once, here: ``Gateway.__init__`` takes the options as
``**options: Unpack[GatewayOptionsKwargs]`` (names and types, no defaults) and the
settings of the config file derive theirs from these fields.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TypedDict

from dedup.errors import ConfigError
from dedup.types import BatchWriter
from dedup.urls import CLUSTER_SCHEMES, DATABASE_SCHEMES, REDIS_SCHEMES, check_url_password

__all__ = [
    "CLUSTER_DEFAULT_SHARDS",
    "MIN_SECRET_CHARS",
    "SHARED_WRITES",
    "GatewayOptions",
    "GatewayOptionsKwargs",
]

SHARED_WRITES = ("auto", "on", "off")
"""Values of ``shared_writes``: across processes while several gateways are alive
(``auto``), always (``on``), or never (``off``: each process writes its own winners)."""

MIN_SECRET_CHARS = 16
"""The shortest ``shared_secret`` accepted: it keys signatures and key names."""

CLUSTER_DEFAULT_SHARDS = 64
"""Hash-tag shards on a cluster when ``cluster_shards`` is 0: without tags a batch
would need one script call per key's slot."""

# Options that must be whole numbers of at least 1.
_AT_LEAST_ONE = (
    "max_batch",
    "max_claim_batches",
    "max_write_batches",
    "max_pending",
    "breaker_failures",
    "degraded_max_statements",
    "degraded_max_queue",
    "shared_queue_max",
)
# Options that must be finite numbers above 0.
_POSITIVE = ("wait_timeout_s", "redis_timeout_s", "breaker_cooldown_s", "degraded_queue_timeout_s")


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    """Every option of :class:`dedup.Gateway`, with its default; checked on construction.

    The Configuration page's option table lists the same names and defaults (a test keeps them
    in step). Derived values (the write budget, the minimum batch fill, the backoff
    bounds, connection counts) are properties, computed from these in one place.
    """

    redis_url: str | None = None
    database_url: str | None = None
    sink: BatchWriter | None = None
    namespace: str = "dedup"
    lease_ms: int = 5000
    wait_timeout_s: float = 10.0
    write_timeout_ms: int | None = None
    local_cache_size: int = 100_000
    max_batch: int = 512
    max_claim_batches: int = 4
    max_write_batches: int = 4
    max_pending: int = 100_000
    redis_timeout_s: float = 2.0
    retention_s: float | None = None
    max_value_bytes: int = 8192
    max_payload_bytes: int = 65536
    data_dir: str | Path = ".dedup"
    migrate: bool | None = None
    allow_eviction: bool = False
    require_redis: bool = False
    cluster_shards: int = 0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 1.0
    degraded_max_statements: int = 2
    degraded_max_queue: int = 10_000
    degraded_queue_timeout_s: float = 1.0
    shared_writes: str = "auto"
    shared_linger_ms: float = 2.0
    shared_queue_max: int = 10_000
    shared_secret: str | None = field(default=None, repr=False)
    shared_learn: bool = True
    marker_layout: str = "compact"
    marker_buckets: int = 65536
    marker_generations: int = 2
    approximate_values: int = 0
    approximate_fp_rate: float = 0.01

    def __post_init__(self) -> None:
        if self.sink is not None and self.database_url is not None:
            raise ConfigError("pass either database_url or sink, not both")
        if self.sink is not None and not callable(self.sink):
            raise ConfigError("sink must be an async callable (see dedup.BatchWriter)")
        _url("redis_url", self.redis_url, REDIS_SCHEMES)
        _url("database_url", self.database_url, DATABASE_SCHEMES)
        if not isinstance(self.namespace, str):
            raise ConfigError("namespace must be a str")
        if not isinstance(self.data_dir, str | Path):
            raise ConfigError("data_dir must be a str or a Path")
        for name in ("migrate",):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name} must be True, False or None")
        for name in ("allow_eviction", "require_redis", "shared_learn"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False")
        _whole(self, "lease_ms", 100)
        for name in _AT_LEAST_ONE:
            _whole(self, name, 1)
        for name in ("local_cache_size", "cluster_shards"):
            _whole(self, name, 0)
        _whole(self, "max_value_bytes", 1)
        _whole(self, "max_payload_bytes", 2)
        for name in _POSITIVE:
            _positive(self, name)
        if self.retention_s is not None:
            _positive(self, "retention_s", " or None")
        if self.write_timeout_ms is not None:
            _whole(self, "write_timeout_ms", 1)
        if not 0 < self.write_timeout_ms_effective < self.lease_ms:
            raise ConfigError("write_timeout_ms must be positive and below lease_ms")
        # A winner writes only with the statement's bound and a margin (write_budget_s)
        # left of its lease, else it renews the lease first: with less than a tenth of the
        # lease around that, no claim would come back soon enough for any winner to write.
        most = math.floor(0.9 * self.lease_ms - min(250, self.lease_ms / 10))
        if self.write_timeout_ms_effective > most:
            raise ConfigError(
                f"write_timeout_ms ({self.write_timeout_ms_effective}) must leave a tenth of "
                f"lease_ms ({self.lease_ms}) after it and its margin: at most {most}"
            )
        if self.shared_writes not in SHARED_WRITES:
            raise ConfigError(f"shared_writes must be one of {', '.join(SHARED_WRITES)}")
        if self.shared_writes == "on" and self.cluster:
            raise ConfigError("shared_writes='on' needs a single Redis server, not a cluster")
        if not (
            type(self.shared_linger_ms) in (int, float)
            and math.isfinite(self.shared_linger_ms)
            and 0 <= self.shared_linger_ms <= 1000
        ):
            raise ConfigError(
                f"shared_linger_ms must be a number from 0 to 1000, got {self.shared_linger_ms!r}"
            )
        if self.shared_secret is not None and (
            not isinstance(self.shared_secret, str) or len(self.shared_secret) < MIN_SECRET_CHARS
        ):
            # The message never holds the secret, only what is wrong with it.
            raise ConfigError(
                f"shared_secret must be text of at least {MIN_SECRET_CHARS} characters, or None"
            )
        if self.marker_layout not in ("compact", "keys"):
            raise ConfigError("marker_layout must be compact or keys")
        _whole(self, "marker_buckets", 1)
        if self.marker_buckets > 1 << 24:
            raise ConfigError(f"marker_buckets must be at most {1 << 24}")
        _whole(self, "marker_generations", 2)
        _whole(self, "approximate_values", 0)
        _positive(self, "approximate_fp_rate")
        if self.approximate_fp_rate >= 0.5:
            raise ConfigError("approximate_fp_rate must be below 0.5")
        if self.approximate_values and self.marker_layout != "compact":
            raise ConfigError("approximate mode replaces the markers: use marker_layout='compact'")
        if self.max_batch > self.max_pending:
            # A single batch could never be admitted.
            raise ConfigError(
                f"max_batch ({self.max_batch}) must not exceed max_pending ({self.max_pending})"
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of option ``name`` (KeyError for a name that is not an option)."""
        for f in fields(cls):
            if f.name == name and f.default is not MISSING:
                return f.default
        raise KeyError(name)

    @classmethod
    def gateway_signature(cls) -> inspect.Signature:
        """``Gateway.__init__``'s signature spelled out from these fields, for ``help()``
        and :func:`inspect.signature`: ``self``, the two URLs (positional or keyword),
        then every other option as a keyword, each with its default and type."""
        positional, keyword = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        params = [inspect.Parameter("self", positional)]
        for f in fields(cls):
            kind = positional if f.name in _POSITIONAL else keyword
            params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
        return inspect.Signature(params, return_annotation="None")

    # ------------------------------------------------------------- derived values

    @property
    def lease_s(self) -> float:
        """The claim lease in seconds."""
        return self.lease_ms / 1000

    @property
    def write_timeout_ms_effective(self) -> int:
        """``write_timeout_ms``, or half the lease when unset."""
        return self.lease_ms // 2 if self.write_timeout_ms is None else self.write_timeout_ms

    @property
    def write_timeout_s(self) -> float:
        """The bound on one database statement, in seconds."""
        return self.write_timeout_ms_effective / 1000

    @property
    def write_budget_s(self) -> float:
        """Lease time a winner must still have to write: the statement's bound plus a
        margin. With less left, it renews the lease first, so a write never outlives it."""
        return self.write_timeout_s + min(0.25, self.lease_s / 10)

    @property
    def min_fill(self) -> int:
        """While a batch is in flight, another starts only once this many are queued
        (like Nagle); with nothing in flight, even one key goes at once."""
        return max(1, self.max_batch // 8)

    @property
    def min_backoff_s(self) -> float:
        """First wait before a busy value is claimed again."""
        return 0.002

    @property
    def max_backoff_s(self) -> float:
        """Longest wait between two claims of a busy value: a quarter lease, at most 0.1 s."""
        return min(0.1, self.lease_s / 4)

    @property
    def redis_connections(self) -> int:
        """The Redis pool's size: one per claim and write batch in flight, plus two
        (the probe, and a commit riding beside a claim), plus what shared writes hold
        at once: the listener's subscription, the writer's blocking pop, a check, a
        publish or a commit for each of its two statements, the heartbeat, the writer
        lease's watchdog and the renewal of the rows this gateway queued."""
        shared = 0 if self.shared_mode == "off" else 7
        return self.max_claim_batches + self.max_write_batches + 2 + shared

    @property
    def shared_mode(self) -> str:
        """``shared_writes`` as it applies: ``off`` on a cluster (the queue is one key)."""
        return "off" if self.cluster else self.shared_writes

    @property
    def secret(self) -> bytes:
        """``shared_secret`` as bytes (empty without one)."""
        return b"" if self.shared_secret is None else self.shared_secret.encode()

    @property
    def retention_ms(self) -> int:
        """Expiry of the saved markers in ms; 0 means kept."""
        return 0 if self.retention_s is None else max(1, int(self.retention_s * 1000))

    @property
    def cluster(self) -> bool:
        """True when ``redis_url`` names a Redis Cluster."""
        return self.redis_url is not None and self.redis_url.startswith(CLUSTER_SCHEMES)

    @property
    def shards(self) -> int:
        """Hash-tag shards in use: ``cluster_shards``, or 64 on a cluster when it is 0."""
        if self.cluster_shards == 0 and self.cluster:
            return CLUSTER_DEFAULT_SHARDS
        return self.cluster_shards

    @property
    def embedded_redis(self) -> bool:
        """True when the Gateway starts its own redis-server (no ``redis_url``)."""
        return self.redis_url is None

    @property
    def embedded_database(self) -> bool:
        """True when the Gateway uses the embedded SQLite file (no URL, no sink)."""
        return self.sink is None and self.database_url is None

    @property
    def migrate_at_open(self) -> bool:
        """Whether the schema is applied at open: ``migrate``, or only for embedded SQLite."""
        return self.embedded_database if self.migrate is None else self.migrate


_POSITIONAL = ("redis_url", "database_url")
"""The options ``Gateway`` also takes by position; every other one is a keyword."""


class GatewayOptionsKwargs(TypedDict, total=False):
    """The keyword options of :class:`dedup.Gateway`: every field of :class:`GatewayOptions`
    but the two URLs, with its type (``**options: Unpack[GatewayOptionsKwargs]``).

    Names and types only: the defaults are :class:`GatewayOptions`' (a test keeps the
    two in step).
    """

    sink: BatchWriter | None
    namespace: str
    lease_ms: int
    wait_timeout_s: float
    write_timeout_ms: int | None
    local_cache_size: int
    max_batch: int
    max_claim_batches: int
    max_write_batches: int
    max_pending: int
    redis_timeout_s: float
    retention_s: float | None
    max_value_bytes: int
    max_payload_bytes: int
    data_dir: str | Path
    migrate: bool | None
    allow_eviction: bool
    require_redis: bool
    cluster_shards: int
    breaker_failures: int
    breaker_cooldown_s: float
    degraded_max_statements: int
    degraded_max_queue: int
    degraded_queue_timeout_s: float
    shared_writes: str
    shared_linger_ms: float
    shared_queue_max: int
    shared_secret: str | None
    shared_learn: bool
    marker_layout: str
    marker_buckets: int
    marker_generations: int
    approximate_values: int
    approximate_fp_rate: float


def _url(name: str, url: Any, schemes: tuple[str, ...]) -> None:
    if url is None:
        return
    if not isinstance(url, str) or not url.startswith(schemes):
        raise ConfigError(f"{name} must start with one of {', '.join(schemes)}")
    check_url_password(url, name)


def _whole(options: GatewayOptions, name: str, minimum: int) -> None:
    value = getattr(options, name)
    if type(value) is not int:
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")


def _positive(options: GatewayOptions, name: str, alternative: str = "") -> None:
    value = getattr(options, name)
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number above 0{alternative}, got {value!r}")
