"""Settings for the command line and the service: flag > DEDUP_* > file > default.

Only ``cli`` and ``service`` read settings and the environment; the core takes
explicit keyword arguments, built here by :meth:`Settings.gateway_kwargs`.

The config file (default ``config/dedup.toml``) has two tables: ``[gateway]``
(:class:`Settings`, the Gateway's options) and ``[service]``
(:class:`ServiceSettings`, the HTTP service's). Every setting of either table can
be overridden by the environment variable ``DEDUP_<NAME>`` (names are unique
across the two tables, so one prefix serves both) and by a command-line flag.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from dedup.errors import ConfigError
from dedup.options import GatewayOptions
from dedup.service.messages import Limits

__all__ = [
    "DEFAULT_CONFIG",
    "ENV_PREFIX",
    "LOG_LEVELS",
    "Config",
    "ServiceSettings",
    "Settings",
    "load_config",
    "load_service_settings",
    "load_settings",
]

DEFAULT_CONFIG = Path("config/dedup.toml")
ENV_PREFIX = "DEDUP_"
LOG_LEVELS = ("debug", "info", "warning", "error")


# A TOML file has no null: the settings spell an option's None thus, here only.
# ``migrate`` also spells True and False, as words.
_NONE_AS: dict[str, Any] = {
    "redis_url": "",  # the embedded default
    "database_url": "",  # the embedded SQLite file
    "write_timeout_ms": 0,  # half the lease
    "retention_s": 0.0,  # markers are kept
    "shared_secret": "",  # no secret
    "migrate": "auto",  # only the embedded SQLite
}
_MIGRATE: dict[str, bool | None] = {"auto": None, "true": True, "false": False}


def _default(name: str) -> Any:
    """The setting's default: the option's, in the settings' spelling."""
    value = GatewayOptions.default(name)
    if name == "migrate":
        return next(word for word, flag in _MIGRATE.items() if flag is value)
    if value is None:
        return _NONE_AS[name]
    return str(value) if isinstance(value, Path) else value


def _option(name: str, value: Any) -> Any:
    """The option a setting spells (the inverse of :func:`_default`'s spelling)."""
    if name == "migrate":
        return _MIGRATE[value]
    if name in _NONE_AS and value == _NONE_AS[name]:
        return None
    return value


@dataclass(frozen=True)
class Settings:
    """Every setting of the ``[gateway]`` table of ``config/dedup.toml``, with its default.

    One per option of :class:`dedup.options.GatewayOptions` (but ``sink``, which is
    code), with that option's default: an empty URL means "embedded default",
    ``write_timeout_ms = 0`` means half the lease, ``retention_s = 0`` means markers
    are kept, and ``migrate`` is ``auto`` (only the embedded SQLite), ``true`` or
    ``false``. :meth:`options` checks them all (:class:`dedup.ConfigError`).
    """

    redis_url: str = _default("redis_url")
    database_url: str = _default("database_url")
    data_dir: str = _default("data_dir")
    namespace: str = _default("namespace")
    lease_ms: int = _default("lease_ms")
    wait_timeout_s: float = _default("wait_timeout_s")
    write_timeout_ms: int = _default("write_timeout_ms")
    local_cache_size: int = _default("local_cache_size")
    max_batch: int = _default("max_batch")
    max_claim_batches: int = _default("max_claim_batches")
    max_write_batches: int = _default("max_write_batches")
    max_pending: int = _default("max_pending")
    redis_timeout_s: float = _default("redis_timeout_s")
    retention_s: float = _default("retention_s")
    max_value_bytes: int = _default("max_value_bytes")
    max_payload_bytes: int = _default("max_payload_bytes")
    migrate: str = _default("migrate")
    allow_eviction: bool = _default("allow_eviction")
    require_redis: bool = _default("require_redis")
    cluster_shards: int = _default("cluster_shards")
    breaker_failures: int = _default("breaker_failures")
    breaker_cooldown_s: float = _default("breaker_cooldown_s")
    degraded_max_statements: int = _default("degraded_max_statements")
    degraded_max_queue: int = _default("degraded_max_queue")
    degraded_queue_timeout_s: float = _default("degraded_queue_timeout_s")
    shared_writes: str = _default("shared_writes")
    shared_linger_ms: float = _default("shared_linger_ms")
    shared_queue_max: int = _default("shared_queue_max")
    shared_secret: str = field(default=_default("shared_secret"), repr=False)
    shared_learn: bool = _default("shared_learn")
    marker_layout: str = _default("marker_layout")
    marker_buckets: int = _default("marker_buckets")
    marker_generations: int = _default("marker_generations")
    approximate_values: int = _default("approximate_values")
    approximate_fp_rate: float = _default("approximate_fp_rate")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"setting {f.name} must be a finite number, got {value!r}")
        if self.migrate not in _MIGRATE:
            raise ConfigError(f"setting migrate must be one of {', '.join(_MIGRATE)}")
        if self.retention_s < 0:
            raise ConfigError("setting retention_s must be positive, or 0 to keep markers")

    def gateway_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`dedup.Gateway`."""
        return {name: _option(name, value) for name, value in dataclasses.asdict(self).items()}

    def options(self) -> GatewayOptions:
        """The Gateway's options, checked (:class:`dedup.ConfigError`), with no I/O."""
        return GatewayOptions(**self.gateway_kwargs())


_LIMITS = Limits()


@dataclass(frozen=True)
class ServiceSettings:
    """Every setting of the ``[service]`` table of ``config/dedup.toml``, with its default.

    Checked on construction: an impossible value raises :class:`dedup.ConfigError`.
    ``auth_token`` is kept out of ``repr`` (and so out of logs and tracebacks).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 1
    auth_token: str = field(default="", repr=False)
    max_body_bytes: int = 1_048_576
    max_batch_items: int = 1000
    drain_timeout_s: float = 30.0
    ready_timeout_s: float = 1.0
    retry_after_s: int = 1
    backlog: int = 1024
    # The HTTP server's bounds: their defaults are written once, in its Limits.
    keepalive_timeout_s: float = _LIMITS.keepalive_timeout_s
    head_timeout_s: float = _LIMITS.head_timeout_s
    body_timeout_s: float = _LIMITS.body_timeout_s
    send_timeout_s: float = _LIMITS.send_timeout_s
    max_head_bytes: int = _LIMITS.max_head_bytes
    max_connections: int = _LIMITS.max_connections
    access_log: bool = False
    log_level: str = "info"
    log_format: str = "text"
    worker_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0-65535, got {self.port}")
        if not 1 <= self.workers <= 256:
            raise ConfigError(f"workers must be 1-256, got {self.workers}")
        if self.workers > 1 and self.port == 0:
            # Every worker binds on its own; with port 0 each would get a different port.
            raise ConfigError("workers > 1 needs a fixed port, not 0")
        for name in (
            "max_body_bytes",
            "max_batch_items",
            "retry_after_s",
            "backlog",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.max_head_bytes < 1024:
            # A usual request's head (a few headers and a bearer token) is under 1 KiB.
            raise ConfigError(f"max_head_bytes must be at least 1024, got {self.max_head_bytes}")
        for f in fields(self):
            value = getattr(self, f.name)
            # NaN compares false with everything, so a bound alone would let it through.
            if isinstance(value, float) and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{f.name} must be a positive finite number, got {value!r}")
        if self.worker_timeout_s < 2:
            # Workers beat every second: a shorter timeout would kill healthy ones.
            raise ConfigError(f"worker_timeout_s must be at least 2, got {self.worker_timeout_s}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in ("text", "json"):
            raise ConfigError("log_format must be text or json")
        if self.auth_token != self.auth_token.strip() or any(
            not 0x21 <= ord(c) <= 0x7E for c in self.auth_token
        ):
            # It travels in an HTTP header: printable ASCII without spaces only.
            raise ConfigError("auth_token must be printable ASCII without spaces")

    def limits(self) -> Limits:
        """What one client may hold of the HTTP server (:class:`dedup.service.http.Limits`),
        from these settings."""
        return Limits(
            keepalive_timeout_s=self.keepalive_timeout_s,
            head_timeout_s=self.head_timeout_s,
            body_timeout_s=self.body_timeout_s,
            send_timeout_s=self.send_timeout_s,
            max_head_bytes=self.max_head_bytes,
            max_connections=self.max_connections,
        )

    @property
    def loopback(self) -> bool:
        """True when ``host`` is reachable from this machine only."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name: assume it is reachable from elsewhere


@dataclass(frozen=True)
class Config:
    """Both tables, merged from every source; ``path`` is the file read (None: none)."""

    gateway: Settings
    service: ServiceSettings
    path: Path | None


_T = TypeVar("_T")
_TABLES: dict[str, type[Any]] = {"gateway": Settings, "service": ServiceSettings}
_KINDS = {"str": str, "int": int, "float": float, "bool": bool}


def _kinds(cls: type[Any]) -> dict[str, type]:
    return {f.name: _KINDS[str(f.type)] for f in fields(cls)}


# One DEDUP_<NAME> per setting: a name in both tables would be ambiguous.
assert not set(_kinds(Settings)) & set(_kinds(ServiceSettings)), "setting names must be unique"


def _convert(name: str, raw: Any, kind: type, origin: str) -> Any:
    """Coerce one setting to its declared type, or raise a ConfigError naming where it came from."""
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind is int and isinstance(raw, float | bool):
            raise ValueError(raw)
        if kind is str and not isinstance(raw, str):
            raise ValueError(raw)
        converted = kind(raw)
    except (TypeError, ValueError):
        # The value itself is not repeated for strings: it may be a secret.
        shown = "a value" if kind is str else repr(raw)
        raise ConfigError(
            f"setting {name} from {origin} must be {kind.__name__}, got {shown}"
        ) from None
    if kind is float and not math.isfinite(converted):
        raise ConfigError(f"setting {name} from {origin} must be a finite number, got {raw!r}")
    return converted


def _read_file(config_path: str | Path | None) -> tuple[dict[str, Any], Path | None]:
    """The parsed config file and its path; ``({}, None)`` when the default file is absent."""
    path = Path(config_path) if config_path is not None else DEFAULT_CONFIG
    if not path.exists():
        if config_path is not None:
            raise ConfigError(f"config file {path} does not exist")
        return {}, None
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    for name, table in document.items():
        if name not in _TABLES:
            raise ConfigError(
                f"{path}: unknown table [{name}]; expected {', '.join(f'[{t}]' for t in _TABLES)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{name}] must be a table")
    return document, path


def _merge(
    cls: type[_T],
    table_name: str,
    document: Mapping[str, Any],
    path: Path | None,
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
) -> _T:
    kinds = _kinds(cls)
    values: dict[str, Any] = {}
    for name, raw in document.get(table_name, {}).items():
        if name not in kinds:
            raise ConfigError(f"{path}: unknown setting {name!r} in [{table_name}]")
        values[name] = _convert(name, raw, kinds[name], str(path))
    for name, kind in kinds.items():
        env_name = ENV_PREFIX + name.upper()
        if env_name in environ:
            values[name] = _convert(name, environ[env_name], kind, env_name)
    for name, raw in flags.items():
        if raw is not None:
            if name not in kinds:
                raise ConfigError(f"unknown setting {name!r}")
            values[name] = _convert(name, raw, kinds[name], f"--{name.replace('_', '-')}")
    return cls(**values)


def load_settings(
    *,
    config_path: str | Path | None,
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
) -> Settings:
    """Merge the sources: ``flags`` (non-None values) > ``DEDUP_*`` in ``environ`` >
    the ``[gateway]`` table of the config file > defaults.

    ``config_path`` None means ``config/dedup.toml`` if it exists; a path given
    explicitly must exist.
    """
    document, path = _read_file(config_path)
    return _merge(Settings, "gateway", document, path, environ, flags)


def load_service_settings(
    *,
    config_path: str | Path | None,
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
) -> ServiceSettings:
    """Like :func:`load_settings`, for the ``[service]`` table."""
    document, path = _read_file(config_path)
    return _merge(ServiceSettings, "service", document, path, environ, flags)


def load_config(
    *,
    config_path: str | Path | None,
    environ: Mapping[str, str],
    gateway_flags: Mapping[str, Any],
    service_flags: Mapping[str, Any],
) -> Config:
    """Both tables from one reading of the file, with the same precedence as
    :func:`load_settings`."""
    document, path = _read_file(config_path)
    return Config(
        gateway=_merge(Settings, "gateway", document, path, environ, gateway_flags),
        service=_merge(ServiceSettings, "service", document, path, environ, service_flags),
        path=path,
    )
