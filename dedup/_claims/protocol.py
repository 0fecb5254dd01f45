"""The batched claim protocol on Redis: one script call decides a whole batch.

``claim`` answers, per key, saved / won / busy; ``commit`` marks keys saved once
their rows are committed; ``abort`` releases leases whose write failed. On a
single server each is one round trip however many keys; on Redis Cluster a batch
is split by hash slot, one script call per slot, and the calls that go to one node
are sent in one pipeline: a round trip per node, whatever the number of slots.
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.cluster import get_node_name
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    ConnectionError,
    MaxConnectionsError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    TimeoutError,
    TryAgainError,
)

from dedup._claims.bloom import BloomLayout, BloomSpec
from dedup._claims.keys import DEFAULT_MARKER_BUCKETS, LAYOUTS, MarkerLayout, key_head
from dedup._claims.scripts import (
    ABORT,
    CLAIM,
    CLAIM_BLOOM,
    CLAIM_COMPACT,
    COMMIT,
    COMMIT_BLOOM,
    COMMIT_COMPACT,
    FORGET,
    FORGET_RELEASE,
    RECLAIM,
)
from dedup._redis.connect import info_of_every_node
from dedup._redis.script import (
    VARIANTS,
    Script,
    ScriptCall,
    ScriptVariant,
    cross_slot,
    render,
    run_script,
    run_together,
)
from dedup._redis.server import script_variant
from dedup.errors import ConfigError
from dedup.metrics import Stats
from dedup.urls import CLUSTER_SCHEMES, REDIS_SCHEMES

__all__ = ["CLUSTER_SCHEMES", "REDIS_SCHEMES", "Claims"]


class _Scripts:
    """The scripts of one :class:`ScriptVariant`, each with its cluster form."""

    __slots__ = (
        "abort",
        "claim",
        "claim_bloom",
        "claim_compact",
        "claims",
        "commit",
        "commit_bloom",
        "commit_compact",
        "cross",
        "forget",
        "forget_release",
        "reclaim",
        "variant",
    )

    def __init__(self, variant: ScriptVariant) -> None:
        self.variant = variant
        self.claim, self.commit, self.abort = (
            Script(render(source, variant)) for source in (CLAIM, COMMIT, ABORT)
        )
        self.claim_compact = Script(render(CLAIM_COMPACT, variant))
        self.commit_compact = Script(render(COMMIT_COMPACT, variant))
        self.claim_bloom = Script(render(CLAIM_BLOOM, variant))
        self.commit_bloom = Script(render(COMMIT_BLOOM, variant))
        self.reclaim = Script(render(RECLAIM, variant))
        self.forget = Script(render(FORGET, variant))
        self.forget_release = Script(render(FORGET_RELEASE, variant))
        # The scripts that answer a letter per key (a cluster batch's answers are merged
        # back into key order for these).
        self.claims = (
            self.claim,
            self.claim_compact,
            self.claim_bloom,
            self.reclaim,
            self.forget,
            self.forget_release,
        )
        every = (*self.claims, self.commit, self.abort, self.commit_compact, self.commit_bloom)
        # Each script's cluster form: one call per node for keys of many slots.
        self.cross = {script: Script(cross_slot(script.source, variant)) for script in every}


_SCRIPTS = {variant: _Scripts(variant) for variant in VARIANTS}
_SKEW_ALLOWANCE_MS = 60_000
# One script call of a cluster batch: its KEYS and ARGV (all keys in one slot).
_Call = tuple[Sequence[bytes], Sequence[Any]]
# Errors after which a cluster batch is retried once, on a refreshed slot map: the
# node (refused, reset, timed out) and the slot (mid-migration, cluster down).
_NODE_ERRORS = (ConnectionError, TimeoutError, OSError)
_SLOT_ERRORS = (TryAgainError, ClusterDownError)
_RETRY_PAUSE_S = 0.05


class _Epoch:
    """The marker epoch, and the prefix of generation names it gives (see
    :attr:`Claims.epoch`)."""

    __slots__ = ("name", "value")

    def __init__(self) -> None:
        self.value = 0
        self.name = b""


class Claims:
    """Claims, commits and aborts leases for batches of keys under one token.

    The token is random per Claims object (one per Gateway): a lease this
    Gateway already holds is extended on a re-claim, never reported busy.

    Keys are :meth:`dedup._claims.keys.KeySpace.key` names; each is also the value's lease
    key. Where "saved" is recorded (see :mod:`dedup._claims.scripts`):

    * ``layout="compact"`` (default): a field of a hash bucket
      (:class:`dedup._claims.keys.MarkerLayout`, ``marker_buckets`` buckets per generation,
      split over ``cluster_shards`` hash tags, which should match the KeySpace's);
    * ``layout="keys"``: the lease key becomes ``"1"`` (the layout before compact markers);
    * ``approximate=BloomSpec(...)``: a Bloom filter (:mod:`dedup._claims.bloom`), opt-in,
      which answers "saved" for a configured fraction of new values.

    The compact and approximate layouts read an old-layout ``"1"`` as saved too.
    With ``retention_ms > 0`` their markers live in generations of
    ``retention_ms / (marker_generations - 1)`` ms, named in the bucket: a claim
    reads the last ``marker_generations``, a commit writes the current one, and each
    generation's buckets expire whole (a marker lives between ``retention_ms`` and
    ``retention_ms * g / (g - 1)`` after its commit). The generation comes from this
    host's clock; a skewed clock only moves a marker's end by the skew (and an
    expired marker costs a redundant INSERT that the database's unique key absorbs).
    """

    __slots__ = (
        "_bloom",
        "_client",
        "_cluster",
        "_epoch",
        "_generations",
        "_lease",
        "_markers",
        "_period_ms",
        "_scripts",
        "_slot_calls",
        "_stats",
        "_token",
        "layout",
        "retention_ms",
    )

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        lease_ms: int,
        retention_ms: int,
        stats: Stats,
        max_parallel: int = 8,
        layout: str = "compact",
        marker_buckets: int = DEFAULT_MARKER_BUCKETS,
        cluster_shards: int = 0,
        marker_generations: int = 2,
        approximate: BloomSpec | None = None,
        variant: ScriptVariant | None = None,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
        if marker_generations < 2:
            raise ValueError("marker_generations must be >= 2")
        if approximate is not None and layout == "keys":
            raise ValueError("approximate mode replaces the markers: use layout='compact'")
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._lease = lease_ms
        self.retention_ms = retention_ms
        self._stats = stats
        self.layout = "approximate" if approximate is not None else layout
        self._markers = MarkerLayout(marker_buckets=marker_buckets, cluster_shards=cluster_shards)
        self._bloom = (
            None if approximate is None else BloomLayout(approximate, cluster_shards=cluster_shards)
        )
        self._generations = marker_generations
        self._period_ms = -(-retention_ms // (marker_generations - 1)) if retention_ms > 0 else 0
        # "L" keeps a token distinct from the saved marker "1" whatever the randomness.
        self._token = "L" + secrets.token_hex(12)
        self._epoch = _Epoch()  # shared with under_own_token's twins
        # On a cluster one batch takes a connection of each node it reaches; bounding
        # them all keeps each node's connections below its pool size (which raises,
        # not waits).
        self._slot_calls = asyncio.Semaphore(max_parallel)
        self._scripts = None if variant is None else _SCRIPTS[variant]

    def under_own_token(self) -> Claims:
        """These claims (same client, layout and scripts) under a token of their own: the
        leases they take and those taken through ``self`` exclude each other, as another
        process's would, where ``self`` would extend its own lease."""
        twin = copy.copy(self)
        twin._token = "L" + secrets.token_hex(12)
        return twin

    @property
    def variant(self) -> ScriptVariant | None:
        """The script variant in use: given at construction
        (:class:`dedup._engine.backends.Backends` passes the one its version check chose),
        or read from the server's ``INFO server`` before the first script call; None until
        then."""
        return None if self._scripts is None else self._scripts.variant

    @variant.setter
    def variant(self, variant: ScriptVariant) -> None:
        self._scripts = _SCRIPTS[variant]

    async def _variant_scripts(self) -> _Scripts:
        """The scripts of :attr:`variant`, reading the server's version first if not known
        (once: one ``INFO server`` call, of every node on a cluster)."""
        scripts = self._scripts
        if scripts is None:
            try:
                info = await info_of_every_node(self._client, "server")
            except NoPermissionError:  # an ACL user without +info: what every version runs
                info = {}
            self._stats.redis_round_trips += 1
            scripts = self._scripts = _SCRIPTS[script_variant(info)]
        return scripts

    @property
    def token(self) -> str:
        """This Claims' lease token (what its leases hold while they last)."""
        return self._token

    @property
    def markers(self) -> MarkerLayout:
        """The compact layout's bucket sizing (bits kept, field bytes)."""
        return self._markers

    @property
    def bloom(self) -> BloomLayout | None:
        """The approximate mode's filter sizing, or None."""
        return self._bloom

    @property
    def epoch(self) -> int:
        """The namespace's marker epoch this Claims reads and writes: every marker of an
        earlier epoch counts as absent (:mod:`dedup._engine.guardian` moves the fleet to
        a new epoch when the database lost rows). 0: the names of before epochs."""
        return self._epoch.value

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._epoch.value = epoch
        self._epoch.name = b"e%d_" % epoch if epoch else b""

    def generations(self, now_ms: int | None = None) -> tuple[list[bytes], int]:
        """The generation names a claim reads, newest first, and when the newest one's
        buckets expire (Unix ms; 0 = never): ``([b""], 0)`` without a retention. An
        epoch after 0 prefixes each name (``e3_``)."""
        period = self._period_ms
        epoch = self._epoch.name
        if not period:
            return [epoch], 0
        now = int(time.time() * 1000) if now_ms is None else now_ms
        g = now // period
        # Readers stop reading a generation at (g + n) * period by their own clocks; the
        # allowance keeps it a little longer for a reader whose clock is behind.
        expire_at = (g + self._generations) * period + min(period, _SKEW_ALLOWANCE_MS)
        return [b"%s%d" % (epoch, g - j) for j in range(self._generations)], expire_at

    async def claim(self, keys: Sequence[bytes]) -> str:
        """One letter per key: ``S`` saved, ``W`` won (lease held), ``B`` busy."""
        script, build = await self._claim_script()
        results = await self._run(script, keys, build)
        return "".join(r.decode() if isinstance(r, bytes) else r for r in results)

    async def claim_then(self, keys: Sequence[bytes], then: ScriptCall) -> tuple[str, Any]:
        """:meth:`claim`, and ``then`` right after it in the same round trip (one Redis
        server only): the letters and ``then``'s result. Shared writes queue the rows of
        the values just won this way, a round trip per claim batch fewer."""
        assert not self._cluster, "one round trip for two scripts needs one Redis server"
        assert isinstance(self._client, Redis)
        if not keys:
            return "", None
        script, build = await self._claim_script()
        self._stats.redis_batches += 1
        (letters, result), trips = await run_together(self._client, [(script, *build(keys)), then])
        self._stats.redis_round_trips += trips
        return (letters.decode() if isinstance(letters, bytes) else letters), result

    async def _claim_script(
        self,
    ) -> tuple[Script, Callable[[Sequence[bytes]], tuple[Sequence[bytes], Sequence[Any]]]]:
        """This layout's claim script, and how it builds KEYS and ARGV for some keys."""
        scripts = await self._variant_scripts()
        if self.layout == "keys":
            head: tuple[Any, ...] = (self._token, self._lease)
            return scripts.claim, lambda ks: (ks, head)
        reads, _ = self.generations()
        script = scripts.claim_compact if self._bloom is None else scripts.claim_bloom
        return script, lambda ks: self._claim_call(ks, reads)

    async def commit(self, keys: Sequence[bytes]) -> int:
        """Mark ``keys`` saved; returns how many still held this token's lease."""
        script, build = await self._commit_script()
        results = await self._run(script, keys, build)
        return sum(int(r) for r in results)

    async def commit_after(
        self, commands: Sequence[Sequence[Any]], keys: Sequence[bytes]
    ) -> tuple[list[Any], int]:
        """Plain ``commands`` (``PUBLISH``, say), then :meth:`commit` of ``keys``, in one
        round trip (one Redis server only): the commands' replies and how many keys
        still held this token's lease. The shared writer answers its claimants and marks
        their values saved this way, a round trip per statement fewer."""
        assert not self._cluster, "one round trip for two steps needs one Redis server"
        assert isinstance(self._client, Redis)
        script, build = await self._commit_script()
        self._stats.redis_batches += 1
        results, trips = await run_together(self._client, [(script, *build(keys))], commands)
        self._stats.redis_round_trips += trips
        return results[:-1], int(results[-1])

    async def _commit_script(
        self,
    ) -> tuple[Script, Callable[[Sequence[bytes]], tuple[Sequence[bytes], Sequence[Any]]]]:
        """This layout's commit script, and how it builds KEYS and ARGV for some keys."""
        scripts = await self._variant_scripts()
        if self.layout == "keys":
            args = (self._token, self.retention_ms, self._lease)
            return scripts.commit, lambda ks: (ks, args)
        reads, expire_at = self.generations()
        script = scripts.commit_compact if self._bloom is None else scripts.commit_bloom
        return script, lambda ks: self._commit_call(ks, reads[0], expire_at)

    async def abort(self, keys: Sequence[bytes]) -> int:
        """Release this token's leases on ``keys``; returns how many were released."""
        args = (self._token,)
        scripts = await self._variant_scripts()
        results = await self._run(scripts.abort, keys, lambda ks: (ks, args))
        return sum(int(r) for r in results)

    async def reclaim(self, keys: Sequence[bytes]) -> str:
        """Claim values whose saved marker outlived their row, ignoring that marker: one
        letter per key, ``W`` won (lease held) or ``B`` busy (another claimant's lease).

        Only for a key that :meth:`claim` answered ``S`` while the database has no row
        for it (the row was deleted, the marker kept): the caller must read the row again
        once it holds the lease, since another runner may have written it in between.
        The marker itself stays (a Bloom bit cannot be cleared alone); the commit that
        ends the run writes it again. A lease taken here is renewed through this method
        too, because :meth:`claim` would keep answering ``S`` for it.
        """
        args = (self._token, self._lease)
        scripts = await self._variant_scripts()
        results = await self._run(scripts.reclaim, keys, lambda ks: (ks, args))
        return "".join(r.decode() if isinstance(r, bytes) else r for r in results)

    async def forget(self, keys: Sequence[bytes], token: str) -> str:
        """Hold ``keys`` for a forget under ``token`` (which starts with ``F``) and clear
        their markers: one letter per key, ``W`` held (markers cleared) or ``B`` busy (a
        save's lease: its write must end first). Held again, a key's lease is extended.
        Not for approximate mode, whose markers cannot be cleared one by one."""
        assert token.startswith("F") and self._bloom is None
        scripts = await self._variant_scripts()
        if self.layout == "keys":
            head: list[Any] = [token, self._lease, 1, 0]
            build: Callable[[Sequence[bytes]], _Call] = lambda ks: (ks, head)  # noqa: E731
        else:
            reads, _ = self.generations()
            locator = self._markers.locator
            fixed = [token, self._lease, self._markers.buckets_per_tag, len(reads), *reads]
            build = lambda ks: (ks, [*fixed, *map(locator, ks)])  # noqa: E731
        results = await self._run(scripts.forget, keys, build)
        return "".join(r.decode() if isinstance(r, bytes) else r for r in results)

    async def forget_release(self, keys: Sequence[bytes], token: str) -> str:
        """Release a forget's hold on ``keys``: one letter per key, ``1`` released, ``0``
        lost (its lease ran out meanwhile)."""
        args = (token,)
        scripts = await self._variant_scripts()
        results = await self._run(scripts.forget_release, keys, lambda ks: (ks, args))
        return "".join(r.decode() if isinstance(r, bytes) else r for r in results)

    @property
    def lease_ms(self) -> int:
        """The lease a claim (or a forget's hold) sets, in milliseconds."""
        return self._lease

    async def states(self, keys: Sequence[bytes]) -> str:
        """One letter per key, read without writing (for tests, tools and debugging, not
        the hot path; one pipeline, not atomic): ``S`` saved (a marker of this layout in
        a generation a claim reads, or an old-layout ``"1"``), ``L`` leased (a token), ``-``
        neither. In approximate mode ``S`` means "probably saved"."""
        if not keys:
            return ""
        reads, _ = self.generations()
        pipe = self._client.pipeline(transaction=False)
        per_key = 1
        for key in keys:
            pipe.get(key)
            if self.layout == "keys":
                continue
            if self._bloom is None:
                buckets, field = self._markers.locate(key, reads)
                for bucket in buckets:
                    pipe.hexists(bucket, field)
                per_key = 1 + len(buckets)
            else:
                parts, bits = self._bloom.locate(key, reads)
                for part in parts:
                    for bit in bits:
                        pipe.getbit(part, bit)
                per_key = 1 + len(parts) * len(bits)
        answers = await pipe.execute()
        out = []
        for i in range(len(keys)):
            value, *marks = answers[i * per_key : (i + 1) * per_key]
            if self._bloom is not None:
                k = self._bloom.k
                groups = [marks[j : j + k] for j in range(0, len(marks), k)]
                saved = any(all(group) for group in groups)
            else:
                saved = any(marks)
            if saved or value == b"1":
                out.append("S")
            elif value is not None:
                out.append("L")
            else:
                out.append("-")
        return "".join(out)

    def _claim_call(
        self, keys: Sequence[bytes], reads: list[bytes]
    ) -> tuple[Sequence[bytes], list[Any]]:
        """KEYS and ARGV of a compact or approximate claim of ``keys``."""
        bloom = self._bloom
        if bloom is None:
            locator = self._markers.locator
            head = [self._token, self._lease, self._markers.buckets_per_tag, len(reads)]
            return keys, [*head, *reads, *map(locator, keys)]
        all_keys, args = list(keys), [self._token, self._lease, len(reads), bloom.k]
        for key in keys:
            parts, bits = bloom.locate(key, reads)
            all_keys.extend(parts)
            args.extend(bits)
        return all_keys, args

    def _commit_call(
        self, keys: Sequence[bytes], current: bytes, expire_at: int
    ) -> tuple[Sequence[bytes], list[Any]]:
        """KEYS and ARGV of a compact or approximate commit of ``keys``."""
        bloom = self._bloom
        if bloom is None:
            locator = self._markers.locator
            head = [self._token, expire_at, self._markers.buckets_per_tag, current, self._lease]
            return keys, [*head, *map(locator, keys)]
        all_keys, args = list(keys), [self._token, expire_at, bloom.k, bloom.partition_bits // 8]
        for key in keys:
            parts, bits = bloom.locate(key, [current])
            all_keys.append(parts[0])
            args.extend(bits)
        return all_keys, args

    async def _run(
        self,
        script: Script,
        keys: Sequence[bytes],
        build: Callable[[Sequence[bytes]], tuple[Sequence[bytes], Sequence[Any]]],
    ) -> list[Any]:
        """Run ``script`` over ``keys`` (KEYS and ARGV from ``build``): one call, or one
        per slot on a cluster (pipelined per node), in key order."""
        if not keys:
            return []
        self._stats.redis_batches += 1
        client = self._client
        if not self._cluster:
            result, trips = await run_script(client, script, *build(keys))
            self._stats.redis_round_trips += trips
            return [result]
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key_slot(key), []).append(i)
        if self.layout != "keys" and any(b"{" not in key_head(keys[i[0]]) for i in groups.values()):
            # Buckets and filters share the lease key's slot through its hash tag only.
            raise ConfigError(
                "the compact and approximate layouts need hash-tagged keys on a "
                "cluster (cluster_shards > 0)"
            )
        answers = await self._per_node(script, keys, groups, build)
        assert self._scripts is not None  # set before any script runs
        if script not in self._scripts.claims:
            return [sum(int(a) for a, _ in answers)]
        # Claim answers are strings: put each letter back at its key's position.
        letters = [""] * len(keys)
        for part, idx in answers:
            text = part.decode() if isinstance(part, bytes) else part
            for i, letter in zip(idx, text, strict=True):
                letters[i] = letter
        return ["".join(letters)]

    async def _per_node(
        self,
        script: Script,
        keys: Sequence[bytes],
        groups: dict[int, list[int]],
        build: Callable[[Sequence[bytes]], _Call],
    ) -> list[tuple[Any, list[int]]]:
        """Run ``script`` over ``keys`` on a cluster: ONE call of its cluster form per
        node, for all the slots of ``groups`` that node serves, all nodes at once. Each
        answer comes with the positions in ``keys`` it answers for.

        A node whose call fails (its slot map is stale: a slot moved away; the node died
        or was paused; it lost the script twice) has its slots run again through
        :meth:`_on_nodes`, one call per slot, which follows MOVED and ASK and retries
        once on a fresh map. That is safe: for one token each script is idempotent, so
        what the failed call did before it stopped is simply done again.
        """
        client = self._client
        assert isinstance(client, RedisCluster)
        try:
            await client.initialize()  # no I/O unless redis-py dropped its slot map
            manager = client.nodes_manager
            nodes: dict[str, tuple[ClusterNode, list[int]]] = {}
            for slot in groups:
                node = manager.get_node_from_slot(slot)
                nodes.setdefault(node.name, (node, []))[1].append(slot)
        except RedisClusterException as exc:  # SlotNotCoveredError: a slot map in flux
            raise ClusterError(f"Redis Cluster slot map unavailable: {exc}") from exc
        todo = [
            (node, slots, [i for slot in slots for i in groups[slot]])
            for node, slots in nodes.values()
        ]
        outcomes = await asyncio.gather(
            *(
                self._node_call(node, script, build([keys[i] for i in idx]))
                for node, _, idx in todo
            ),
            return_exceptions=True,
        )
        answers: list[tuple[Any, list[int]]] = []
        again: list[int] = []  # slots to run one by one
        failed: list[ClusterNode] = []
        for (node, slots, idx), outcome in zip(todo, outcomes, strict=True):
            if not isinstance(outcome, BaseException):
                answers.append((outcome, idx))
            elif isinstance(outcome, RedisError | OSError):
                again.extend(slots)
                if isinstance(outcome, _NODE_ERRORS) and not isinstance(
                    outcome, MaxConnectionsError
                ):
                    failed.append(node)
            else:
                raise outcome
        if again:
            # A refreshed map first when a node failed, so the calls per slot do not wait
            # on it a second time.
            if failed:
                await self._refresh_slots(failed, [], full=True)
            slot_calls = {slot: build([keys[i] for i in groups[slot]]) for slot in again}
            per_slot = await self._on_nodes(script, slot_calls)
            answers.extend((per_slot[slot], groups[slot]) for slot in again)
        return answers

    async def _node_call(self, node: ClusterNode, script: Script, call: _Call) -> Any:
        """One call of ``script``'s cluster form on ``node`` (loaded first if the node
        answers NOSCRIPT: 3 round trips instead of 1)."""
        assert self._scripts is not None  # set before any script runs
        cross = self._scripts.cross[script]
        call_keys, args = call
        command = ("EVALSHA", cross.sha, 0, len(call_keys), *call_keys, *args)
        async with self._slot_calls:
            try:
                answer = await node.execute_command(*command)
            except NoScriptError:
                await node.execute_command("SCRIPT", "LOAD", cross.source)
                self._stats.redis_round_trips += 2
                answer = await node.execute_command(*command)
            finally:
                self._stats.redis_round_trips += 1
        return answer

    async def _on_nodes(self, script: Script, calls: dict[int, _Call]) -> dict[int, Any]:
        """Run one script call per slot of ``calls``, in ONE pipeline per node that owns
        any of them (all nodes at once): the batch costs a round trip per node, not per
        slot. Returns each slot's answer.

        redis-py's cluster pipeline would route EVALSHA too, but pays its per-command
        routing cost again for every slot (and redis-py issue #2914: some versions
        refuse EVALSHA there); the slots are known here already, so each node's
        commands go straight onto one of that node's own connections.

        A slot answered MOVED, ASK, TRYAGAIN or CLUSTERDOWN, or a node that failed
        (connection refused or reset, timeout: a primary killed, a failover under way),
        has its calls retried ONCE after the slot map is refreshed (a MOVED patches it
        in place; anything else reads CLUSTER SLOTS again). That is safe: for one token
        each script is idempotent (a claim finds its own lease and extends it, a commit
        finds the key saved already, an abort finds nothing to release). If the retry
        fails too, the last error is raised (a :class:`RedisError`): the engine goes
        degraded and its probe closes the circuit once the cluster serves again.
        """
        client = self._client
        assert isinstance(client, RedisCluster)
        try:
            await client.initialize()  # no I/O unless redis-py dropped its slot map
        except RedisClusterException as exc:
            raise ClusterError(f"Redis Cluster slot map unavailable: {exc}") from exc
        answers: dict[int, Any] = {}
        pending: dict[int, str | None] = dict.fromkeys(calls)  # slot -> ASK target
        for attempt in range(2):
            nodes: dict[str, tuple[ClusterNode, list[tuple[int, str | None]]]] = {}
            manager = client.nodes_manager
            try:
                for slot, ask in pending.items():
                    node = manager.get_node(node_name=ask) if ask is not None else None
                    if node is None:
                        node, ask = manager.get_node_from_slot(slot), None
                    nodes.setdefault(node.name, (node, []))[1].append((slot, ask))
            except RedisClusterException as exc:  # SlotNotCoveredError: a slot map in flux
                raise ClusterError(f"Redis Cluster slot map incomplete: {exc}") from exc
            outcomes = await asyncio.gather(
                *(self._node_pipeline(node, script, calls, todo) for node, todo in nodes.values()),
                return_exceptions=True,
            )
            retry: dict[int, str | None] = {}
            failed_nodes: list[ClusterNode] = []
            redirects: list[MovedError] = []
            error: BaseException | None = None
            stale = False  # the slot map needs CLUSTER SLOTS again
            for (node, todo), outcome in zip(nodes.values(), outcomes, strict=True):
                results = outcome if isinstance(outcome, list) else [outcome] * len(todo)
                for (slot, _), answer in zip(todo, results, strict=True):
                    if not isinstance(answer, BaseException):
                        answers[slot] = answer
                        continue
                    if isinstance(answer, MovedError):
                        redirects.append(answer)
                        retry[slot] = None
                    elif isinstance(answer, AskError):
                        retry[slot] = get_node_name(answer.host, answer.port)
                    elif isinstance(answer, _SLOT_ERRORS):
                        retry[slot], stale = None, True
                    elif isinstance(answer, _NODE_ERRORS) and not isinstance(
                        answer, MaxConnectionsError
                    ):  # refused, reset (also mid-read), timed out: a node down or moving
                        if node not in failed_nodes:
                            failed_nodes.append(node)
                        retry[slot], stale = None, True
                    else:
                        raise answer
                    error = answer
            if not retry:
                return answers
            if attempt == 1:
                break
            pending = retry
            await self._refresh_slots(failed_nodes, redirects, full=stale)
        assert error is not None
        raise error

    async def _refresh_slots(
        self, failed_nodes: list[ClusterNode], redirects: list[MovedError], *, full: bool
    ) -> None:
        """Bring the slot map up to date after a failed node or a redirect: drop the failed
        nodes' connections, then patch the map from the MOVED answers, or read CLUSTER
        SLOTS again (one round trip) when something else went wrong."""
        client = self._client
        assert isinstance(client, RedisCluster)
        manager = client.nodes_manager
        for node in failed_nodes:
            node.update_active_connections_for_reconnect()
            await node.disconnect_free_connections()
            manager.move_node_to_end_of_cached_nodes(node.name)
        if not full:
            for moved in redirects:  # resharding: patch the map, no round trip
                await manager.move_slot(moved)
            return
        await asyncio.sleep(_RETRY_PAUSE_S)  # TRYAGAIN, CLUSTERDOWN: let the cluster settle
        try:
            await manager.initialize(
                last_failed_node_name=failed_nodes[0].name if failed_nodes else None
            )
        except RedisClusterException as exc:
            raise ClusterError(f"Redis Cluster slot map unavailable: {exc}") from exc
        except (RedisError, OSError) as exc:
            raise ConnectionError(f"Redis Cluster slot map unavailable: {exc}") from exc
        finally:
            self._stats.redis_round_trips += 1

    async def _node_pipeline(
        self,
        node: ClusterNode,
        script: Script,
        calls: dict[int, _Call],
        todo: list[tuple[int, str | None]],
    ) -> list[Any]:
        """Send the script calls of ``todo``'s slots to ``node`` in one pipeline (each
        preceded by ASKING where an ASK redirect named this node); per slot, its answer or
        the error it got. A node that lost the script (restarted, failed over, flushed)
        gets it loaded and the calls it refused sent again: 3 round trips instead of 1."""
        async with self._slot_calls:
            answers = await self._send(node, script, calls, todo)
            self._stats.redis_round_trips += 1
            again = [i for i, answer in enumerate(answers) if isinstance(answer, NoScriptError)]
            if again:
                await node.execute_command("SCRIPT", "LOAD", script.source)
                retried = await self._send(node, script, calls, [todo[i] for i in again])
                self._stats.redis_round_trips += 2
                for i, answer in zip(again, retried, strict=True):
                    answers[i] = answer
            return answers

    @staticmethod
    async def _send(
        node: ClusterNode,
        script: Script,
        calls: dict[int, _Call],
        todo: list[tuple[int, str | None]],
    ) -> list[Any]:
        commands: list[PipelineCommand] = []
        evals: list[PipelineCommand] = []
        for slot, ask in todo:
            if ask is not None:
                commands.append(PipelineCommand(len(commands), "ASKING"))
            call_keys, args = calls[slot]
            command = PipelineCommand(
                len(commands), "EVALSHA", script.sha, len(call_keys), *call_keys, *args
            )
            commands.append(command)
            evals.append(command)
        await node.execute_pipeline(commands)
        return [command.result for command in evals]
