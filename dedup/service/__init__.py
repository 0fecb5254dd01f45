"""The HTTP ingest service behind ``dedup serve``: the app (:mod:`.app`), its metrics
(:mod:`.metrics`), the OpenAPI document (:mod:`.openapi`), logging (:mod:`.logs`), the
settings every source feeds (:mod:`.settings`) and the process supervisor (:mod:`.supervisor`).
"""

from __future__ import annotations

from dedup.service.app import (
    HEARTBEAT_INTERVAL_S,
    create_app,
    serve,
    setup_logging,
)

__all__ = [
    "HEARTBEAT_INTERVAL_S",
    "create_app",
    "serve",
    "setup_logging",
]
