"""A throwaway Redis Sentinel deployment on 127.0.0.1 (a primary, replicas, sentinels),
for tests; built on :class:`dedup.testing.servers.RedisServer`."""

from __future__ import annotations

import secrets
import time
from types import TracebackType
from typing import Any, Self

import redis

from dedup.testing.process import HOST, START_TIMEOUT, ServerError
from dedup.testing.servers import RedisServer

__all__ = ["SERVICE", "RedisSentinelServers", "SentinelServer"]

SERVICE = "mymaster"
"""The name the sentinels monitor the primary under."""

_AT_ONCE = ("--repl-diskless-sync-delay", "0")
"""A primary (or a replica, once promoted) syncs its replicas at once, not after the 5 s
a diskless sync waits for more of them (Redis 7's default)."""


class SentinelServer(RedisServer):
    """One ``redis-server --sentinel`` with a config file of its own (a sentinel rewrites
    it), monitoring the primary at ``primary_port`` with a quorum of ``quorum``.

    Its run id is :attr:`myid`. :meth:`knows` writes the replicas and the other
    sentinels into its config before it starts, as a sentinel records what it learnt:
    it then starts knowing them rather than learning them from the primary's INFO and
    the hello messages of the next seconds (it still checks them as it runs)."""

    _name = "redis-sentinel"

    def __init__(
        self, primary_port: int, *, quorum: int, down_after_ms: int, binary: str | None = None
    ) -> None:
        super().__init__(binary=binary)
        self.myid = secrets.token_hex(20)
        self._conf = self.dir / "sentinel.conf"
        self._conf.write_text(
            f"port {self.port}\n"
            f"bind {HOST}\n"
            f"dir {self.dir}\n"
            f"sentinel myid {self.myid}\n"
            f"sentinel monitor {SERVICE} {HOST} {primary_port} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {max(3000, 4 * down_after_ms)}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )

    def knows(self, replicas: list[RedisServer], sentinels: list[SentinelServer]) -> None:
        """Write ``replicas`` and the other ``sentinels`` into the config (before start)."""
        with self._conf.open("a") as conf:
            for replica in replicas:
                conf.write(f"sentinel known-replica {SERVICE} {HOST} {replica.port}\n")
            for other in sentinels:
                if other is not self:
                    conf.write(
                        f"sentinel known-sentinel {SERVICE} {HOST} {other.port} {other.myid}\n"
                    )

    def _argv(self) -> list[str]:
        return [self._binary, str(self._conf), "--sentinel", "--daemonize", "no"]


class RedisSentinelServers:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels (quorum: a majority),
    each a process of its own on a free loopback port. :meth:`start` returns once the
    replicas are in sync and every sentinel knows the replicas and the other sentinels,
    so that a failover can be elected. ``down_after_ms``: how long a silent primary takes
    to be judged down. Kill, pause and resume the servers by PID as usual."""

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        *,
        down_after_ms: int = 1000,
        binary: str | None = None,
    ) -> None:
        self.primary = RedisServer(binary=binary, extra_args=_AT_ONCE)
        self._binary = binary
        self._replicas = replicas
        self._sentinels = sentinels
        self._down_after_ms = down_after_ms
        self.replicas: list[RedisServer] = []
        self.sentinels: list[SentinelServer] = []

    @property
    def url(self) -> str:
        """The ``redis+sentinel://`` URL of the service (database 0)."""
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    @property
    def servers(self) -> list[RedisServer]:
        """The primary and the replicas as started (one of them may be primary now)."""
        return [self.primary, *self.replicas]

    def command(self, node: RedisServer, *args: Any, timeout: float = 5.0) -> Any:
        """Run one command on ``node`` (a fresh connection, answers decoded)."""
        client = redis.Redis(
            host=HOST, port=node.port, socket_timeout=timeout, socket_connect_timeout=timeout,
            decode_responses=True,
        )  # fmt: skip
        try:
            return client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def _named_by(self, sentinel: SentinelServer) -> int | None:
        """The primary's port as ``sentinel`` names it (None: it does not answer)."""
        try:
            address = self.command(
                sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE, timeout=1.0
            )
        except redis.RedisError:
            return None
        return int(address[1]) if address else None

    def primary_port(self) -> int | None:
        """The primary's port as the first sentinel that answers names it (None: none does)."""
        return next((p for s in self.sentinels if (p := self._named_by(s)) is not None), None)

    def named_by_all(self, port: int) -> bool:
        """Whether every sentinel names the server on ``port`` as the primary (after a
        failover they learn it from each other within a couple of seconds)."""
        return all(self._named_by(s) == port for s in self.sentinels)

    def role(self, node: RedisServer) -> str:
        """``master`` or ``slave``, as ``node`` says (ROLE)."""
        return str(self.command(node, "ROLE", timeout=1.0)[0])

    def start(self) -> Self:
        try:
            self.primary.start()
            for _ in range(self._replicas):
                replica = RedisServer(
                    binary=self._binary,
                    extra_args=[*_AT_ONCE, "--replicaof", HOST, str(self.primary.port)],
                )
                self.replicas.append(replica)
                replica.start()
            quorum = self._sentinels // 2 + 1
            for _ in range(self._sentinels):
                sentinel = SentinelServer(
                    self.primary.port,
                    quorum=quorum,
                    down_after_ms=self._down_after_ms,
                    binary=self._binary,
                )
                self.sentinels.append(sentinel)
            for sentinel in self.sentinels:
                sentinel.knows(self.replicas, self.sentinels)
                sentinel.start()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 3 * START_TIMEOUT
        while True:
            if self._ready():
                return
            if time.monotonic() > deadline:
                raise ServerError("the sentinels did not find the replicas and each other")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            info = self.command(self.primary, "INFO", "replication")
            if int(info.get("connected_slaves", 0)) < self._replicas:
                return False
            for i in range(self._replicas):
                if info.get(f"slave{i}", {}).get("state") != "online":
                    return False
            for sentinel in self.sentinels:
                known = self.command(sentinel, "SENTINEL", "REPLICAS", SERVICE)
                others = self.command(sentinel, "SENTINEL", "SENTINELS", SERVICE)
                if len(known) < self._replicas or len(others) < self._sentinels - 1:
                    return False
        except redis.RedisError:
            return False
        return True

    def stop(self) -> None:
        """Stop every process (sentinels first, so that none starts a failover)."""
        for server in [*self.sentinels, *self.replicas, self.primary]:
            server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
