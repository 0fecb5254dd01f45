"""``make load``: throwaway servers, the service, locust headless, and a summary.

    .venv/bin/python loadtest/run.py [--seconds 15] [--users 32] [--phases single,batch]
                                     [--values 1000000] [--batch 100] [--out load-results]

Starts a private redis-server and PostgreSQL cluster (dedup.testing.servers: 127.0.0.1, free ports,
PostgreSQL as the ``postgres`` user when run as root), migrates, starts ``dedup serve`` on
a free port, then runs locust headless once per phase, each for ``--seconds``:

- ``single``: ``SingleSaveUser`` of loadtest/locustfile.py (``POST /v1/save``);
- ``batch``: ``BatchSaveUser`` (``POST /v1/save/batch``, ``--batch`` items each);
- ``lib``: ``LibrarySaveUser`` of loadtest/locustfile_lib.py (a Gateway in locust's own
  process, no HTTP; not in the default phases).

Each phase writes ``<out>/<phase>_stats.csv`` (and the other CSVs), ``<out>/<phase>.html``
and ``<out>/<phase>.log``; its items go to a kind of its own (``load-<phase>``). The summary
reads locust's CSV (requests/s, items/s, percentiles) and its JSON file (the final request
and failure counts) per phase, and checks that the table holds exactly one row per distinct
value answered and one ``created`` answer per row. A second table gives the CPU each
process used during each phase (from /proc) and the items per CPU-second of the gateway,
the per-core figure that sizing multiplies. Exit status 0 only when every phase had
requests, no failure, and those checks pass.

Everything started here is stopped by its PID at the end, also on Ctrl-C or SIGTERM; every
wait is bounded (locust runs for ``--seconds`` plus at most ``--stop-timeout``).
``--seconds`` defaults to ``DEDUP_LOAD_SECONDS`` or 15.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402

from dedup.store.migrate import upgrade  # noqa: E402
from dedup.testing.servers import PostgresCluster, RedisServer, free_port  # noqa: E402

PHASES = {
    "single": ("locustfile.py", "SingleSaveUser", "/v1/save"),
    "batch": ("locustfile.py", "BatchSaveUser", "/v1/save/batch"),
    "lib": ("locustfile_lib.py", "LibrarySaveUser", None),
}
SERVICE_START_TIMEOUT_S = 60.0
SERVICE_STOP_TIMEOUT_S = 40.0
STOP_TIMEOUT_S = 10  # locust's --stop-timeout: users finish the request they are in
LOCUST_GRACE_S = 60.0  # beyond --seconds + --stop-timeout, locust is killed


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, from /proc (Linux; just ``pid`` elsewhere)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = (entry / "stat").read_text()
                    parent = int(stat[stat.rfind(")") + 2 :].split()[1])
                    children.setdefault(parent, []).append(int(entry.name))
    found, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) used so far by ``pid``, its live descendants and the
    descendants that ended and were waited for."""
    total = 0
    for p in _proc_tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            # utime, stime, and cutime, cstime: children that ended (PostgreSQL backends)
            total += sum(int(f) for f in fields[11:15])
    return total / _TICKS_PER_S


def children_cpu_seconds() -> float:
    """CPU time of this process's children that ended and were waited for (locust)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived: unwind, stopping everything we started."""


@dataclass
class PhaseResult:
    """One locust run, as its CSV and record files tell it."""

    phase: str
    requests: int
    failures: int
    requests_per_s: float
    items_per_s: float
    p50_ms: float
    p99_ms: float
    rows: int
    answered: int
    created: int
    exit_code: int
    wall_s: float
    cpu_s: dict[str, float]  # CPU seconds used during the phase: service, redis, postgres, locust

    @property
    def items(self) -> int:
        return self.requests * self.batch

    batch: int = 1

    @property
    def ok(self) -> bool:
        return (
            self.exit_code == 0
            and self.requests > 0
            and self.failures == 0
            and self.rows == self.answered == self.created
        )


def _stop_signals(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


def parse_stats(path: Path) -> dict[str, dict[str, str]]:
    """locust's ``*_stats.csv``: its rows by name (``Aggregated`` is the total)."""
    with open(path, newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def read_totals(path: Path) -> tuple[int, int]:
    """(requests, failures) from locust's ``--json-file``, which is written once at the very
    end; the CSV is a snapshot rewritten every second, so it may miss the last second."""
    entries = json.loads(path.read_text())
    return sum(e["num_requests"] for e in entries), sum(e["num_failures"] for e in entries)


def read_record(path: Path) -> tuple[set[str], int]:
    """(distinct values answered, ``created`` answers) over every process's line."""
    answered: set[str] = set()
    created = 0
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            answered.update(entry["answered"])
            created += int(entry["created"])
    return answered, created


class Service:
    """``python -m dedup serve`` in a session of its own, stopped by its PID."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dedup", "serve", "--host", "127.0.0.1",
                 "--port", str(self.port)],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dedup serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as r:  # noqa: S310
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"dedup serve not ready in {SERVICE_START_TIMEOUT_S}s")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """SIGTERM (it drains), bounded wait, then SIGKILL of its process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=SERVICE_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def run_locust(argv: Sequence[str], env: dict[str, str], log_path: Path, timeout_s: float) -> int:
    """Run locust to its end (bounded); its output goes to ``log_path``."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "locust", *argv], cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            return proc.wait(timeout=timeout_s)
        except BaseException:
            # Timed out or interrupted: SIGTERM (locust writes its reports), then SIGKILL.
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            raise


COUNT_ROWS = "SELECT count(*) FROM dedup_items WHERE kind = $1"


async def _count_rows(database_url: str, kind: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        return int(await conn.fetchval(COUNT_ROWS, kind))
    finally:
        await conn.close()


def count_rows(database_url: str, kind: str) -> int:
    """Rows of ``kind`` in the table."""
    return asyncio.run(_count_rows(database_url, kind))


def run_phase(
    phase: str,
    args: argparse.Namespace,
    env: dict[str, str],
    service: Service,
    database_url: str,
    redis_pid: int,
    postgres_pid: int,
) -> PhaseResult:
    locustfile, user_class, row_name = PHASES[phase]
    out: Path = args.out
    prefix = out / phase
    record = out / f"{phase}.record.jsonl"
    record.unlink(missing_ok=True)
    kind = f"load-{phase}"
    phase_env = {
        **env,
        "DEDUP_LOAD_KIND": kind,
        "DEDUP_LOAD_VALUES": str(args.values),
        "DEDUP_LOAD_BATCH": str(args.batch),
        "DEDUP_LOAD_RECORD": str(record),
    }
    argv = [
        "-f", str(HERE / locustfile), "--headless", "--only-summary",
        "-u", str(args.users), "-r", str(args.users), "-t", f"{args.seconds}s",
        "--stop-timeout", str(STOP_TIMEOUT_S), "--csv", str(prefix),
        "--html", str(out / f"{phase}.html"), "--json-file", str(prefix), "--loglevel", "INFO",
    ]  # fmt: skip
    if row_name is not None:
        argv += ["--host", service.url]
    if args.processes > 1:
        argv += ["--processes", str(args.processes)]
    argv.append(user_class)
    timeout = args.seconds + STOP_TIMEOUT_S + LOCUST_GRACE_S
    watched = {"service": service.proc.pid, "redis": redis_pid, "postgres": postgres_pid}
    cpu_before = {name: cpu_seconds(pid) for name, pid in watched.items()}
    cpu_before["locust"] = children_cpu_seconds()
    started = time.monotonic()
    code = run_locust(argv, phase_env, out / f"{phase}.log", timeout)
    wall_s = time.monotonic() - started
    cpu_after = {name: cpu_seconds(pid) for name, pid in watched.items()}
    cpu_after["locust"] = children_cpu_seconds()
    stats = parse_stats(Path(f"{prefix}_stats.csv"))
    total = stats["Aggregated"]
    requests, failures = read_totals(Path(f"{prefix}.json"))
    per_s = float(total["Requests/s"])
    items = args.batch if phase == "batch" else 1
    answered, created = read_record(record)
    return PhaseResult(
        phase=phase,
        requests=requests,
        failures=failures,
        requests_per_s=per_s,
        items_per_s=per_s * items,
        p50_ms=float(total["50%"] or 0),
        p99_ms=float(total["99%"] or 0),
        rows=count_rows(database_url, kind),
        answered=len(answered),
        created=created,
        exit_code=code,
        wall_s=wall_s,
        cpu_s={name: cpu_after[name] - cpu_before[name] for name in cpu_after},
        batch=items,
    )


def print_summary(results: Sequence[PhaseResult], args: argparse.Namespace) -> None:
    print(
        f"\nlocust headless, {args.users} users, {args.seconds} s per phase, "
        f"Zipf(1.1) over {args.values:,} values, batch {args.batch}; reports in {args.out}/"
    )
    header = (
        f"{'phase':<8}{'requests':>10}{'failures':>10}{'req/s':>10}{'items/s':>10}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'rows':>9}{'answered':>10}{'created':>9}  check"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.phase:<8}{r.requests:>10,}{r.failures:>10,}{r.requests_per_s:>10,.0f}"
            f"{r.items_per_s:>10,.0f}{r.p50_ms:>9.1f}{r.p99_ms:>9.1f}{r.rows:>9,}"
            f"{r.answered:>10,}{r.created:>9,}  {'PASS' if r.ok else 'FAIL'}"
        )
    print(
        "\nCPU during each phase (cores busy = CPU seconds / wall seconds; the lib phase's"
        " Gateway runs inside locust's process)"
    )
    header = (
        f"{'phase':<8}{'wall s':>8}{'service':>9}{'redis':>8}{'postgres':>10}{'locust':>8}"
        f"  {'items per CPU-second of the gateway':>36}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        busy = {name: cpu / r.wall_s for name, cpu in r.cpu_s.items()}
        gateway_cpu = r.cpu_s["locust" if r.phase == "lib" else "service"]
        per_core = r.items / gateway_cpu if gateway_cpu > 0 else float("nan")
        print(
            f"{r.phase:<8}{r.wall_s:>8.1f}{busy['service']:>9.2f}{busy['redis']:>8.2f}"
            f"{busy['postgres']:>10.2f}{busy['locust']:>8.2f}  {per_core:>36,.0f}"
        )
    failures = sum(r.failures for r in results)
    print(f"failures: {failures}")


@contextlib.contextmanager
def servers() -> Iterator[tuple[RedisServer, PostgresCluster]]:
    with RedisServer() as redis_server, PostgresCluster() as cluster:
        yield redis_server, cluster


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    default_s = int(os.environ.get("DEDUP_LOAD_SECONDS", "") or 15)
    parser.add_argument("--seconds", type=int, default=default_s, help="per phase (%(default)s)")
    parser.add_argument("--users", type=int, default=32, help="locust users (%(default)s)")
    parser.add_argument("--processes", type=int, default=1, help="locust --processes")
    parser.add_argument("--phases", default="single,batch", help="of single,batch,lib")
    parser.add_argument("--values", type=int, default=1_000_000, help="Zipf over N values")
    parser.add_argument("--batch", type=int, default=100, help="items per batch request")
    parser.add_argument("--out", type=Path, default=ROOT / "load-results")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases or args.seconds < 1 or args.users < 1:
        parser.error(f"phases are {', '.join(PHASES)}; seconds and users must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)

    previous = {s: signal.signal(s, _stop_signals) for s in (signal.SIGTERM, signal.SIGINT)}
    results: list[PhaseResult] = []
    try:
        with servers() as (redis_server, cluster):
            dbname = "dedup"
            database_url = cluster.create_database(dbname)
            upgrade(database_url)
            env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
            env.update(DEDUP_REDIS_URL=redis_server.url, DEDUP_DATABASE_URL=database_url)
            service = Service(env, args.out / "serve.log")
            try:
                service.wait_ready()
                for phase in phases:
                    print(f"[load] {phase}: {args.seconds} s ...", file=sys.stderr, flush=True)
                    results.append(
                        run_phase(
                            phase, args, env, service, database_url, redis_server.pid, cluster.pid
                        )
                    )
            finally:
                service.stop()
    except Interrupted as exc:
        print(f"[load] interrupted ({exc}): everything started was stopped", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print_summary(results, args)
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
