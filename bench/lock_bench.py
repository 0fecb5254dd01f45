"""Lock throughput under contention: dedup.lock.Lock against redis-py's Lock, one run.

    .venv/bin/python bench/lock_bench.py [--processes 4] [--tasks 4] [--seconds 3]
                                         [--names 1,1000] [--hold-ms 0] [--redlock-nodes 5]
                                         [--rounds 3] [--streaks 1,4,64]

Starts its own redis-servers (see dedup.testing.servers). For each shape (a number of lock
names) and variant, ``processes`` OS processes with ``tasks`` asyncio tasks each
loop acquire + release for ``seconds``, each acquisition on a name drawn at random
from the shape's names; every task has its own Lock object per name. Then, over
``redlock-nodes`` servers and the last shape's names: dedup's Redlock against
taking one dedup Lock on every node (in parallel) and releasing them. Printed
per variant: acquisitions per second; requests the clients sent per acquisition
(writes to the server, each a round trip: the acquire, the release, every failed
attempt or poll; dedup's calls of one process's tasks that share a write count once);
commands the server ran per acquisition (INFO ``total_commands_processed``, which
also counts each command inside a script); and the time spent inside
``acquire()`` (median, 99th percentile and the longest: a lock that lets some tasks
starve while others take it again at once can show a small p99 over the acquisitions
that were made, and only the longest wait tells); and the least-served task: the
fewest acquisitions one task made, as a share of an even split (all acquisitions
over all tasks), which shows starvation even when the starved task's last wait was
cut off by the end of the run and so never counted as a wait.

``--streaks`` adds dedup variants (default ``sleep``) with the library's private
``_HANDOVER_STREAK`` (handovers within a process before it yields to other
processes' waiters, 16) set to each value: the trade-off between fairness and the
p99 on one hot name, measured.

Every variant runs ``rounds`` times, the variants alternating (the order reversed
every other round) so that drift of the machine falls on all of them alike; the row
shown is the round with the median acquisitions/s, and the last column lists every
round's. Before a shape's first round each of its names is taken once with a dedup
Lock, untimed: a name's first grant within ``fence_memory_s`` costs 2 commands more
(the fence counter starts from the server clock: ``TIME``, ``SET``), a one-off a
long-running service pays once per name and minute, which a 3 s run would otherwise
spread over its few acquisitions per name. Not a test: figures depend on the machine
and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

from redis import Redis as SyncRedis
from redis.asyncio import Connection, Redis
from redis.asyncio.lock import Lock as RedisLock

from dedup.lock import Lock, Redlock
from dedup.testing.servers import RedisServer

# (label, lock class, keyword arguments of the Lock)
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("redis-py Lock, sleep=0.1 (default)", "redis-py", {"sleep": 0.1}),
    ("redis-py Lock, sleep=0.001", "redis-py", {"sleep": 0.001}),
    ("dedup Lock, sleep=0.1 (default)", "dedup", {"sleep": 0.1}),
    ("dedup Lock, sleep=1.0", "dedup", {"sleep": 1.0}),
]
REDLOCK_VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    # The nodes start with the run: their uptime is below the TTL, so the restart
    # guard would make every node abstain.
    ("dedup Redlock (restart_guard off)", "redlock", {"timeout": 10, "restart_guard": False}),
    ("N x dedup Lock, in parallel", "n-locks", {"timeout": 10}),
]

START_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------- child


class _CountingConnection(Connection):
    """Counts the requests the locks send: each write to the server, a round trip (a
    script is one request, however many commands it runs on the server; lock calls that
    share a write count once). PubSub pushes are not requests."""

    requests = 0

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        _CountingConnection.requests += 1
        await super().send_packed_command(command, check_health)


class _NLocks:
    """One dedup Lock per node, taken in parallel: the yardstick for a Redlock."""

    def __init__(self, clients: list[Redis], name: str, **options: Any) -> None:
        self._locks = [Lock(client, name, **options) for client in clients]

    async def acquire(self, blocking_timeout: float) -> bool:
        got = await asyncio.gather(
            *(lk.acquire(blocking_timeout=blocking_timeout) for lk in self._locks)
        )
        if all(got):
            return True
        await asyncio.gather(*(lk.release() for lk, ok in zip(self._locks, got, strict=True) if ok))
        return False

    async def release(self) -> None:
        await asyncio.gather(*(lk.release() for lk in self._locks))

    async def settled(self) -> None:
        await asyncio.gather(*(lk.settled() for lk in self._locks))


async def _child(job: dict[str, Any]) -> None:
    if job.get("streak") is not None:
        import dedup.lock.lock

        dedup.lock.lock._HANDOVER_STREAK = job["streak"]
    clients = [Redis.from_url(url, connection_class=_CountingConnection) for url in job["urls"]]
    redis = clients[0]

    made: list[Any] = []

    def make(name: str) -> Any:
        lock: Any
        if job["cls"] == "redlock":
            lock = Redlock(clients, name, **job["options"])
        elif job["cls"] == "n-locks":
            lock = _NLocks(clients, name, **job["options"])
        else:
            cls = Lock if job["cls"] == "dedup" else RedisLock
            lock = cls(redis, name, **job["options"])
        made.append(lock)
        return lock

    try:
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        stop_at = time.monotonic() + job["seconds"]
        waits: list[float] = []
        counts: list[int] = []

        async def worker() -> None:
            number = len(counts)
            counts.append(0)
            locks: dict[str, Any] = {}
            while True:
                left = stop_at - time.monotonic()
                if left <= 0:
                    return
                name = f"bench:{random.randrange(job['names'])}"
                lock = locks.get(name)
                if lock is None:
                    lock = locks[name] = make(name)
                started = time.monotonic()
                if not await lock.acquire(blocking_timeout=left):
                    return
                waits.append(time.monotonic() - started)
                counts[number] += 1
                if job["hold_ms"]:
                    await asyncio.sleep(job["hold_ms"] / 1000)
                await lock.release()

        _CountingConnection.requests = 0
        await asyncio.gather(*(worker() for _ in range(job["tasks"])))
        requests = _CountingConnection.requests
        # A task that gave up when time ran out may have been handed a lock meanwhile;
        # its release is still on its way: let it arrive before the clients close, or
        # the next round finds the name held.
        for lock in made:
            if isinstance(lock, Lock | _NLocks):
                await lock.settled()
        print(json.dumps({"waits": waits, "counts": counts, "requests": requests}), flush=True)
    finally:
        for client in clients:
            await client.aclose()


# --------------------------------------------------------------------------- parent


def _commands(url: str) -> int:
    client = SyncRedis.from_url(url)
    try:
        stats: dict[str, Any] = client.info("stats")
        return int(stats["total_commands_processed"])
    finally:
        client.close()


def _run_variant(
    urls: list[str], args: argparse.Namespace, names: int, cls: str, options: dict[str, Any]
) -> dict[str, Any]:
    job = {
        "urls": urls,
        "cls": cls,
        "options": {key: value for key, value in options.items() if key != "_streak"},
        "seconds": args.seconds,
        "tasks": args.tasks,
        "names": names,
        "hold_ms": args.hold_ms,
        "streak": options.get("_streak"),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(args.processes)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "READY":
                raise RuntimeError(f"a benchmark child failed to start ({cls})")
        before = sum(_commands(url) for url in urls)
        started = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        waits: list[float] = []
        counts: list[int] = []
        requests = 0
        for proc in procs:
            out, _ = proc.communicate(timeout=args.seconds + START_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"a benchmark child exited with {proc.returncode}")
            result = json.loads(out.strip().splitlines()[-1])
            waits += result["waits"]
            counts += result["counts"]
            requests += result["requests"]
        elapsed = time.monotonic() - started
        commands = sum(_commands(url) for url in urls) - before
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    count = len(waits)
    cuts = statistics.quantiles(waits, n=100) if count >= 2 else [0.0] * 99
    return {
        "count": count,
        "per_s": count / elapsed,
        "requests_per_acquire": requests / count if count else float("nan"),
        "commands_per_acquire": commands / count if count else float("nan"),
        "p50_ms": cuts[49] * 1000,
        "p99_ms": cuts[98] * 1000,
        "max_ms": max(waits, default=0.0) * 1000,
        "least_served": min(counts) * len(counts) / count if count else 0.0,
    }


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median acquisitions/s, with every round's rate beside it."""
    ordered = sorted(rounds, key=lambda res: float(res["per_s"]))
    return {**ordered[(len(ordered) - 1) // 2], "rounds": [res["per_s"] for res in rounds]}


def _run_rounds(
    urls: list[str],
    args: argparse.Namespace,
    names: int,
    variants: list[tuple[str, str, dict[str, Any]]],
) -> list[tuple[str, dict[str, Any]]]:
    """Every variant ``args.rounds`` times, alternating; the median round of each."""
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in variants}
    for number in range(args.rounds):
        order = variants if number % 2 == 0 else variants[::-1]
        for label, cls, options in order:
            results[label].append(_run_variant(urls, args, names, cls, options))
    return [(label, _median_round(results[label])) for label, _, _ in variants]


async def _warm_fences(urls: list[str], names: int) -> None:
    """Take every name of the shape once on every server, so that the timed rounds
    find each fence counter alive (see the module's docstring)."""
    for url in urls:
        client = Redis.from_url(url)
        try:
            for number in range(names):
                lock = Lock(client, f"bench:{number}", timeout=10)
                if await lock.acquire(blocking_timeout=10):
                    await lock.release()
        finally:
            await client.aclose()


def _table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    head = (
        f"{'lock':<36} {'acquire+release/s':>18} {'requests/acq':>13} {'server cmds/acq':>16} "
        f"{'wait p50':>10} {'wait p99':>10} {'wait max':>10} {'least served':>12}"
        "  acquire+release/s of every round"
    )
    lines = [head, "-" * len(head)]
    for label, res in rows:
        every = " / ".join(f"{rate:,.0f}" for rate in res["rounds"])
        lines.append(
            f"{label:<36} {res['per_s']:>18,.0f} {res['requests_per_acquire']:>13.1f} "
            f"{res['commands_per_acquire']:>16.1f} {res['p50_ms']:>8.1f}ms {res['p99_ms']:>8.1f}ms "
            f"{res['max_ms']:>8.1f}ms {res['least_served']:>12.0%}  {every}"
        )
    return "\n".join(lines)


def main() -> None:
    """Parse the arguments; run every variant on a private redis-server; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=4, help="OS processes (default 4)")
    parser.add_argument("--tasks", type=int, default=4, help="asyncio tasks per process (4)")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration per variant (3)")
    parser.add_argument(
        "--names", default="1,1000", help="shapes: distinct lock names, comma-separated (1,1000)"
    )
    parser.add_argument(
        "--redlock-nodes", type=int, default=5, help="servers for the Redlock rows (5; 0: none)"
    )
    parser.add_argument("--hold-ms", type=float, default=0.0, help="time held per acquire (0)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of every variant, alternating (3)"
    )
    parser.add_argument(
        "--streaks",
        default="",
        help="extra dedup variants, one per handover streak, comma-separated (none)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(_child(json.loads(args.child)))
        return
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    command = shlex.join([sys.executable, *sys.argv])
    shapes = [int(n) for n in args.names.split(",")]
    variants = VARIANTS + [
        (f"dedup Lock, handover streak {n}", "dedup", {"sleep": 0.1, "_streak": int(n)})
        for n in args.streaks.split(",")
        if n
    ]
    print(
        f"{args.processes} processes x {args.tasks} tasks, "
        f"{args.seconds:g} s per variant and round, {args.rounds} rounds, hold {args.hold_ms:g} ms"
    )
    with RedisServer() as server:
        for names in shapes:
            asyncio.run(_warm_fences([server.url], names))
            rows = _run_rounds([server.url], args, names, variants)
            print(f"\n{names} lock name(s)")
            print(_table(rows))
    if args.redlock_nodes > 0:
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(RedisServer()) for _ in range(args.redlock_nodes)]
            urls = [server.url for server in servers]
            asyncio.run(_warm_fences(urls, shapes[-1]))
            rows = [
                (label.replace("N x", f"{len(urls)} x"), res)
                for label, res in _run_rounds(urls, args, shapes[-1], REDLOCK_VARIANTS)
            ]
        print(
            f"\n{args.redlock_nodes} nodes, {shapes[-1]} lock name(s), timeout 10 s; "
            "commands summed over the nodes"
        )
        print(_table(rows))
    print(f"\ncommand: {command}")


if __name__ == "__main__":
    main()
