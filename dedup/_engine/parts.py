"""The open Gateway's parts, as one value: what code beside the hot path may use.

The run-once methods ``once``, ``get`` and ``filter`` (:mod:`dedup._engine.once`) work on an
open Gateway through this view rather than through its private attributes, so the
engine's layout can change without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dedup._claims.keys import KeySpace
from dedup._claims.protocol import Claims
from dedup._engine.local import SavedCache
from dedup._values import Limits
from dedup.metrics import Stats
from dedup.store import DefaultSink
from dedup.types import BatchWriter

__all__ = ["EngineParts"]


@dataclass(frozen=True, slots=True)
class EngineParts:
    """The parts of an open Gateway.

    ``claims`` runs the claim/commit/abort scripts under the Gateway's own lease
    token (a re-claim of a lease it holds extends it); ``sink`` is the write step
    (the default sink or the embedding application's); ``default_sink`` is None
    with a custom sink. ``degraded()`` is True while Redis is skipped.
    """

    keys: KeySpace
    limits: Limits
    claims: Claims
    sink: BatchWriter
    default_sink: DefaultSink | None
    local: SavedCache
    stats: Stats
    lease_ms: int
    wait_timeout_s: float
    write_timeout_s: float
    degraded: Callable[[], bool]
