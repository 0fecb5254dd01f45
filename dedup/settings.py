"""Settings for the command line (and, later, the service): flag > DEDUP_* > file > default.

Only ``cli`` and ``service`` read settings and the environment; the core takes
explicit keyword arguments, built here by :meth:`Settings.gateway_kwargs`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dedup.errors import ConfigError

__all__ = ["DEFAULT_CONFIG", "ENV_PREFIX", "Settings", "load_settings"]

DEFAULT_CONFIG = Path("config/dedup.toml")
ENV_PREFIX = "DEDUP_"


@dataclass(frozen=True)
class Settings:
    """Every setting of the ``[gateway]`` table of ``config/dedup.toml``, with its default.

    An empty URL means "embedded default".
    """

    redis_url: str = ""
    database_url: str = ""
    data_dir: str = ".dedup"
    namespace: str = "dedup"
    lease_ms: int = 5000
    wait_timeout_s: float = 10.0
    local_cache_size: int = 100_000
    max_batch: int = 512
    max_claim_batches: int = 4
    max_write_batches: int = 4
    max_pending: int = 100_000
    redis_timeout_s: float = 2.0
    retention_s: float = 0.0
    max_value_bytes: int = 8192
    max_payload_bytes: int = 65536
    allow_eviction: bool = False
    cluster_shards: int = 0

    def gateway_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`dedup.Gateway`."""
        kwargs = dataclasses.asdict(self)
        kwargs["redis_url"] = self.redis_url or None
        kwargs["database_url"] = self.database_url or None
        kwargs["retention_s"] = self.retention_s or None
        return kwargs


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
        return kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(
            f"setting {name} from {origin} must be {kind.__name__}, got {raw!r}"
        ) from None


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
    types = {f.name: f.type for f in fields(Settings)}
    kinds = {
        name: {"str": str, "int": int, "float": float, "bool": bool}[str(t)]
        for name, t in types.items()
    }
    values: dict[str, Any] = {}

    path = Path(config_path) if config_path is not None else DEFAULT_CONFIG
    if path.exists():
        try:
            document = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        table = document.get("gateway", {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [gateway] must be a table")
        for name, raw in table.items():
            if name not in kinds:
                raise ConfigError(f"{path}: unknown setting {name!r} in [gateway]")
            values[name] = _convert(name, raw, kinds[name], str(path))
    elif config_path is not None:
        raise ConfigError(f"config file {path} does not exist")

    for name, kind in kinds.items():
        env_name = ENV_PREFIX + name.upper()
        if env_name in environ:
            values[name] = _convert(name, environ[env_name], kind, env_name)

    for name, raw in flags.items():
        if raw is not None:
            if name not in kinds:
                raise ConfigError(f"unknown setting {name!r}")
            values[name] = _convert(name, raw, kinds[name], f"--{name.replace('_', '-')}")
    return Settings(**values)
