"""A throwaway Redis Cluster (primaries, optional replicas) on 127.0.0.1, for tests and
benchmarks; built on :class:`dedup.testing.servers.RedisServer`, without redis-cli."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

import redis

from dedup._redis.embedded import server_version
from dedup.testing.process import HOST, START_TIMEOUT, ServerError, free_port
from dedup.testing.servers import RedisServer, find_redis_server

__all__ = ["RedisClusterServers"]

_BUS_OFFSET = 10_000  # a node's cluster bus port before Redis 7.0: its port + 10000


def _port_with_bus() -> int:
    """A free port whose ``port + 10000`` is a free port too (Redis 6's cluster bus)."""
    for _ in range(200):
        port = free_port()
        if port + _BUS_OFFSET > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port + _BUS_OFFSET))
            except OSError:
                continue
        return port
    raise ServerError("no free port p with p + 10000 free too (Redis 6's cluster bus)")


class RedisClusterServers:
    """A throwaway Redis Cluster on 127.0.0.1: ``primaries`` redis-servers with all
    16,384 slots split evenly between them, and ``replicas`` replicas per primary.

    Built with plain cluster commands (no redis-cli needed): each node gets a distinct
    config epoch, its slots (CLUSTER ADDSLOTS), MEETs the others, and replicas
    CLUSTER REPLICATE their primary; :meth:`start` returns once every node reports
    ``cluster_state:ok`` and every replica has synced. The bus port of each node is a
    free port of its own (``cluster-port``, redis-server 7.0 or later), not ``port + 10000``
    (which may be past 65535); before 7.0, where the bus is always ``port + 10000``, each
    node gets a port low enough for that, with both free.

    ``node_timeout_ms`` is ``cluster-node-timeout``: how long a silent primary takes to
    be marked failed and replaced by its replica (``cluster-replica-validity-factor 0``
    lets any replica take over, however long it was disconnected). Nodes are the
    :class:`RedisServer` objects in :attr:`nodes` (primaries first, then replicas in
    the same order): kill, pause and resume them by PID as usual; :meth:`stop`
    SIGCONTs, then stops each one.
    """

    _name = "redis cluster"

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 0,
        *,
        node_timeout_ms: int = 2000,
        extra_args: Sequence[str] = (),
    ) -> None:
        if primaries < 1 or replicas < 0:
            raise ValueError("a cluster needs >= 1 primary and >= 0 replicas per primary")
        self.node_timeout_ms = node_timeout_ms
        self._primaries = primaries
        self._replicas = replicas
        self._extra_args = list(extra_args)
        self.nodes: list[RedisServer] = []
        self.ids: dict[int, str] = {}  # port -> node id
        # By node, not by port: a node whose free port was taken before it bound starts
        # on another one (RedisServer.start), and its bus port stays what it was given.
        self._bus_ports: dict[RedisServer, int] = {}

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL with the first node as the seed."""
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def url_of(self, node: RedisServer) -> str:
        """``redis+cluster://`` URL seeded with ``node``."""
        return f"redis+cluster://{HOST}:{node.port}"

    def command(
        self, node: RedisServer, *args: str | int | bytes, timeout: float = 5.0, decode: bool = True
    ) -> Any:
        """Run one command on ``node`` (a fresh connection; answers decoded unless not
        ``decode``)."""
        client = redis.Redis(
            host=HOST, port=node.port, socket_timeout=timeout, socket_connect_timeout=timeout,
            decode_responses=decode,
        )  # fmt: skip
        try:
            return client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def start(self) -> Self:
        total = self._primaries * (1 + self._replicas)
        try:
            for _ in range(total):
                node = self._new_node()
                node.start()
                self.nodes.append(node)
            primaries = self.nodes[: self._primaries]
            per = 16384 // self._primaries
            for i, node in enumerate(self.nodes):
                self.ids[node.port] = str(self.command(node, "CLUSTER", "MYID"))
                self.command(node, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for i, node in enumerate(primaries):
                last = 16383 if i + 1 == self._primaries else (i + 1) * per - 1
                self.command(node, "CLUSTER", "ADDSLOTS", *range(i * per, last + 1))
            first = self.nodes[0]
            for node in self.nodes[1:]:
                self.command(first, "CLUSTER", "MEET", HOST, node.port, self._bus_ports[node])
            self._wait("every node to know every other", self._all_met)
            for j, replica in enumerate(self.nodes[self._primaries :]):
                primary = primaries[j % self._primaries]
                self.command(replica, "CLUSTER", "REPLICATE", self.ids[primary.port])
            self.wait_ok()
            self._wait("every replica to sync", self._replicas_synced)
        except BaseException:
            self.stop()
            raise
        return self

    def _new_node(self) -> RedisServer:
        args = [
            "--cluster-enabled", "yes",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",
            "--repl-diskless-sync-delay", "0",  # replicas sync at once, not after 5 s
            *self._extra_args,
        ]  # fmt: skip
        if server_version(find_redis_server()) >= (7, 0, 0):
            bus = free_port()
            node = RedisServer(extra_args=[*args, "--cluster-port", str(bus)])
        else:
            port = _port_with_bus()
            bus = port + _BUS_OFFSET
            node = RedisServer(port, extra_args=args)
        self._bus_ports[node] = bus
        return node

    def _wait(self, what: str, check: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                logs = "\n".join(f"{n!r}:\n{n.log_text()}" for n in self.nodes)
                raise ServerError(f"{self._name}: gave up waiting for {what} ({timeout} s)\n{logs}")
            time.sleep(0.05)

    def _all_met(self) -> bool:
        want = len(self.nodes)
        for node in self.nodes:
            text = str(self.command(node, "CLUSTER", "NODES"))
            lines = [line for line in text.splitlines() if line.strip()]
            if len(lines) < want or "handshake" in text or "noaddr" in text:
                return False
        return True

    def _replicas_synced(self) -> bool:
        for replica in self.nodes[self._primaries :]:
            info = self.command(replica, "INFO", "replication")
            if info.get("master_link_status") != "up":
                return False
        return True

    def live(self) -> list[RedisServer]:
        """The nodes whose process is running and answers PING."""
        return [n for n in self.nodes if n.is_alive() and n.ping(timeout=0.5)]

    def cluster_ok(self, nodes: Sequence[RedisServer] | None = None) -> bool:
        """True when every node of ``nodes`` (default: the live ones) says cluster_state:ok."""
        for node in self.live() if nodes is None else nodes:
            try:
                text = str(self.command(node, "CLUSTER", "INFO", timeout=1.0))
            except redis.RedisError:
                return False
            if "cluster_state:ok" not in text:
                return False
        return True

    def wait_ok(self, timeout: float = START_TIMEOUT) -> None:
        """Wait (bounded) until every live node says ``cluster_state:ok``."""
        self._wait("cluster_state:ok on every live node", self.cluster_ok, timeout)

    def role(self, node: RedisServer, *, via: RedisServer | None = None) -> tuple[str, str | None]:
        """``("master", None)`` or ``("slave", primary's node id)`` for ``node``, as the node
        ``via`` (default: ``node`` itself) sees it in CLUSTER NODES."""
        text = str(self.command(via or node, "CLUSTER", "NODES", timeout=1.0))
        for line in text.splitlines():
            fields = line.split()
            if fields and fields[0] == self.ids[node.port]:
                flags = fields[2].split(",")
                if "master" in flags:
                    return "master", None
                return "slave", fields[3]
        raise ServerError(f"{node!r} is not in CLUSTER NODES of {(via or node)!r}")

    def primaries(self) -> list[RedisServer]:
        """The nodes that are primaries now, as the first live node sees it."""
        via = self.live()[0]
        return [n for n in self.nodes if self.role(n, via=via)[0] == "master"]

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The nodes replicating ``primary`` now, as the first live node sees it."""
        via, wanted = self.live()[0], self.ids[primary.port]
        return [n for n in self.nodes if self.role(n, via=via) == ("slave", wanted)]

    def node_of_key(self, key: bytes | str) -> RedisServer:
        """The node that owns ``key``'s slot now (CLUSTER SHARDS of a live node)."""
        via = self.live()[0]
        slot = int(self.command(via, "CLUSTER", "KEYSLOT", key))
        for node in self.primaries():
            for low, high in self._slots(node):
                if low <= slot <= high:
                    return node
        raise ServerError(f"no node owns slot {slot}")

    def _slots(self, node: RedisServer) -> list[tuple[int, int]]:
        out = []
        for slot_range in self.command(node, "CLUSTER", "SLOTS"):
            if int(slot_range[2][1]) == node.port:
                out.append((int(slot_range[0]), int(slot_range[1])))
        return out

    def stop(self) -> None:
        """SIGCONT, SIGTERM, wait, SIGKILL every node (by PID); remove their folders."""
        errors = []
        for node in self.nodes:
            try:
                node.stop()
            except ServerError as exc:  # stop the others anyway
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisClusterServers({[n.port for n in self.nodes]})"
