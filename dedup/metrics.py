"""Counters of one Gateway: answers per tier, and the work sent to Redis and the database."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Stats"]


@dataclass(slots=True)
class Stats:
    """Counters since the Gateway opened; ``Gateway.stats()`` returns a copy.

    Answers: ``local``, ``inflight``, ``redis``, ``db``, ``write`` count saves
    by where their answer came from (``write`` is the number of ``created=True``).
    Work: ``redis_round_trips`` (script calls and other commands sent; on a cluster one
    per node pipeline), ``redis_batches`` (claim, commit and abort script calls: one per
    batch however many nodes it spans, so a batch's sequential round trip),
    ``db_statements`` (one per write batch) and ``db_rows_sent`` (rows offered to the
    sink, including those that turned out to exist already).
    Events: ``claim_batches``, ``busy`` (answers "another
    writer holds it", each re-checked later), ``reclaims`` (winners whose lease
    was nearly spent and was renewed before writing), ``lost_leases`` (rows
    committed after the lease had passed to someone else), ``wait_timeouts``,
    ``redis_errors``, ``db_errors``, ``overloaded``.
    Degraded mode: ``breaker_opens`` (times the circuit opened because Redis
    failed) and ``degraded_answers`` (values answered by a degraded write, with
    Redis skipped; they are also counted in ``write`` or ``db``).
    Shared writes: ``shared_rows_queued`` (winners' rows this gateway queued for
    the fleet's writer), ``shared_rows_own`` (winners' rows it wrote in its own
    statements as that writer, without queuing them), ``shared_statements``
    (statements it wrote as that writer, also counted in ``db_statements``),
    ``shared_rows_returned`` (queued rows it took back and wrote itself: no word in
    time, or the writer answered "write it yourself"), ``shared_queue_full`` (rows it
    wrote itself because the queue was at ``shared_queue_max``), ``shared_bad_messages``
    (queued rows, answers and saved-values messages it skipped as malformed, forged or
    meant for another sink), ``shared_learned`` (values its local tier learned from
    the fleet's saved-values broadcast: the writer's statements, and batches gateways
    wrote themselves) and ``shared_busy_answered`` (busy values that the
    saved-values broadcast answered before their next claim; also counted in ``redis``).
    The database as the source of truth (:mod:`dedup._engine.guardian`):
    ``tombstones_drained`` (rows deleted by something other than dedup whose markers
    and local entries this gateway cleared) and ``marker_resets`` (times this gateway
    found that the database lost writes, or was told to reconcile, and reset every
    marker of the namespace).
    """

    local: int = 0
    inflight: int = 0
    redis: int = 0
    db: int = 0
    write: int = 0
    redis_round_trips: int = 0
    redis_batches: int = 0
    db_statements: int = 0
    db_rows_sent: int = 0
    claim_batches: int = 0
    busy: int = 0
    reclaims: int = 0
    lost_leases: int = 0
    wait_timeouts: int = 0
    redis_errors: int = 0
    db_errors: int = 0
    overloaded: int = 0
    breaker_opens: int = 0
    degraded_answers: int = 0
    shared_rows_queued: int = 0
    shared_rows_own: int = 0
    shared_statements: int = 0
    shared_rows_returned: int = 0
    shared_queue_full: int = 0
    shared_bad_messages: int = 0
    shared_learned: int = 0
    shared_busy_answered: int = 0
    tombstones_drained: int = 0
    marker_resets: int = 0

    @property
    def answers(self) -> int:
        """All successful answers, whatever their tier."""
        return self.local + self.inflight + self.redis + self.db + self.write

    def copy(self) -> Stats:
        """A snapshot that later counting does not change."""
        return Stats(**asdict(self))

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for JSON and tables)."""
        return asdict(self)
