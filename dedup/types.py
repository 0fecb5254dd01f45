"""Plain data shared by every layer: results, rows and the sink interface."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["BatchWriter", "Item", "Reconciled", "Row", "SaveResult", "Source"]

Source = Literal["local", "inflight", "redis", "db", "write"]
"""Where an answer came from.

``local``: the in-process cache of saved values; ``inflight``: another call of
this process was already saving the value; ``redis``: the shared "saved" marker;
``db``: this process wrote but the row already existed; ``write``: this call's
own write inserted the row.
"""

Item = tuple[str, str] | tuple[str, str, Any]
"""One element of ``save_many``: ``(kind, value)`` or ``(kind, value, payload)``."""


@dataclass(frozen=True, slots=True)
class SaveResult:
    """The answer to one save: the row is committed, by this call or by another.

    ``created`` is True exactly when ``source == "write"``.
    """

    created: bool
    source: Source


@dataclass(frozen=True, slots=True)
class Row:
    """One row handed to a sink: the unique key is ``(kind, digest)``.

    ``payload_json`` is the payload already serialised to JSON text (or None).
    """

    kind: str
    digest: bytes
    value: str
    payload_json: str | None


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What :meth:`dedup.Gateway.reconcile` did: every marker of the namespace reset."""

    epoch: int
    """The namespace's marker epoch now: markers of earlier epochs count as absent."""
    tombstones: int
    """Tombstones drained: rows deleted outside dedup whose markers were cleared."""
    swept: int
    """Redis keys of earlier epochs (and markers of the ``keys`` layout) deleted."""


BatchWriter = Callable[[Sequence[Row]], Awaitable[Iterable[tuple[str, bytes]]]]
"""A pluggable write step.

It receives a batch of rows with distinct ``(kind, digest)`` keys, sorted by
them, inserts them in one statement (rows whose key already exists are left
alone) and returns the ``(kind, digest)`` keys of the rows it inserted. It must
return only once the rows are durable, and raise if it could not write.
"""
