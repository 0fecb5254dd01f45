"""The ``dedup`` command: ``demo``, ``migrate``, ``bench``, ``serve``, ``check``,
``forget`` and ``prune``.

Settings reach every subcommand as flag > ``DEDUP_*`` environment variable >
``--config`` file (default ``config/dedup.toml``) > built-in default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

from dedup.cli.forget import DEFAULT_BATCH_SIZE, older_than_arg, positive_int_arg
from dedup.errors import DedupError
from dedup.loop import run
from dedup.service.settings import Config, Settings, load_config, load_settings
from dedup.urls import embedded_sqlite_url

__all__ = ["build_parser", "main"]

T = TypeVar("T")


def _installed_version() -> str:
    """The installed distribution's version (the package's own when run from a tree
    that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    from dedup import __version__

    try:
        return version("dedup")
    except PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dedup`` command (every subcommand and flag)."""
    parser = argparse.ArgumentParser(
        prog="dedup", description="Write-deduplication gateway on Redis and PostgreSQL."
    )
    parser.add_argument("--config", help="TOML settings file (default: config/dedup.toml)")
    parser.add_argument("--version", action="version", version=f"dedup {_installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        # SUPPRESS: given after the subcommand it wins, absent it leaves the global one alone.
        p.add_argument("--config", default=argparse.SUPPRESS, help="TOML settings file")
        p.add_argument("--redis-url", help="redis://, rediss://, unix:// (default: embedded)")
        p.add_argument("--database-url", help="postgresql:// or sqlite:/// (default: embedded)")
        p.add_argument("--data-dir", help="folder of the embedded default (default: .dedup)")

    def log_format(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--log-format",
            choices=["text", "json"],
            help="text (default), or json: one JSON object per line, tracebacks included",
        )

    demo = sub.add_parser("demo", help="replay a synthetic stream and check rows == unique values")
    common(demo)
    demo.add_argument("--events", type=int, default=1_000_000, help="events (default 1,000,000)")
    demo.add_argument("--values", type=int, default=200_000, help="distinct values (200,000)")
    demo.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent, 0 = uniform (1.1)")
    demo.add_argument("--concurrency", type=int, default=256, help="concurrent producers (256)")
    demo.add_argument("--seed", type=int, default=1, help="random seed of the stream (1)")

    migrate = sub.add_parser("migrate", help="create or upgrade the dedup_items table")
    common(migrate)

    bench = sub.add_parser(
        "bench",
        help="dedup against the textbook pattern and the database alone, 1 to N processes",
        description="Lists are comma-separated. --quick changes the defaults to a run of "
        "about a minute (20,000 requests, concurrency 128,512, processes 1,2, rate 20000); "
        "flags given still win.",
    )
    bench.add_argument(
        "--redis-url",
        help="a Redis to use, or a redis+cluster:// URL (default: start a throwaway one)",
    )
    bench.add_argument(
        "--database-url", help="a PostgreSQL database (default: start a throwaway cluster)"
    )
    bench.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    bench.add_argument("--requests", type=int, help="requests per run (default 1,000,000)")
    bench.add_argument(
        "--concurrency",
        help="callers in all, split over the processes; the first for the process sweep, "
        "each in one process on every workload (default 256,1024)",
    )
    bench.add_argument(
        "--processes", help="process counts of the sweep on the first workload (default 1,4,8,16)"
    )
    bench.add_argument("--workloads", help="zipf and/or uniform (default zipf,uniform)")
    bench.add_argument(
        "--strategies",
        help="of textbook, redis-lock, db-only, db-plain, dedup (default db-only,dedup; the "
        "first two run in one process only; db-plain checks db-only)",
    )
    bench.add_argument(
        "--rate",
        help="open-loop runs: requests/s offered in all, at every process count "
        "(default none; e.g. 200000 or 100k,200k)",
    )
    bench.add_argument(
        "--outstanding",
        type=int,
        help="open loop: bound on requests in flight, in all (default 1,024)",
    )
    bench.add_argument(
        "--memory-values",
        help="values saved for the memory figures, through the gateway and in each marker "
        "layout (default 1,000,000; --quick 50,000; e.g. 10m)",
    )
    bench.add_argument(
        "--cluster",
        action="store_true",
        help="also start a throwaway 3-primary Redis Cluster and run every Redis run on it "
        "too, right after the same run on one Redis, and compare them (req/s, round trips "
        "and batches per request, per node)",
    )
    bench.add_argument("--out", default="bench-results", help="folder of bench.json and the chart")

    serve = sub.add_parser("serve", help="run the HTTP ingest service (see docs/service.md)")
    common(serve)
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default 8080)")
    serve.add_argument("--workers", type=int, help="worker processes sharing the port (default 1)")
    log_format(serve)

    check = sub.add_parser(
        "check", help="validate the settings and reach Redis and the database; report findings"
    )
    common(check)

    forget = sub.add_parser(
        "forget",
        help="forget values of a kind: delete their rows and markers, so they save anew",
        description="Forget each VALUE (or each line of --file) of --kind: its row is deleted "
        "and its markers cleared, so a later save creates it again. Every value is checked "
        "before anything is deleted. Prints 'forgot N of M values (K had no row)'; exit 2 "
        "for bad input, 1 when the servers cannot serve or the gateway cannot erase.",
    )
    common(forget)
    log_format(forget)
    forget.add_argument("--kind", required=True, help="the values' kind")
    forget.add_argument(
        "--file",
        metavar="PATH",
        help="one value a line, UTF-8 ('-': standard input); only each line's final "
        "newline is removed, empty lines are skipped",
    )
    forget.add_argument(
        "values",
        nargs="*",
        metavar="VALUE",
        help="values to forget (put -- before a value that starts with -)",
    )

    reconcile = sub.add_parser(
        "reconcile",
        help="reset every marker after a database restore, and drain deleted rows' markers",
        description="Make the markers true to the database again: drain the tombstones of "
        "rows deleted outside dedup, reset every marker of the namespace (every gateway "
        "moves to a new marker epoch and drops its local tier), then delete the old markers. "
        "Safe while the fleet saves. Gateways notice SQL deletes, restores and failovers by "
        "themselves; run this after a restore they cannot see (a SQLite file put back, a "
        "dump reloaded).",
    )
    common(reconcile)
    log_format(reconcile)

    prune = sub.add_parser(
        "prune",
        help="delete the rows of a kind older than a duration, in batches (resumable)",
        description="Delete the rows of --kind created more than --older-than ago, in "
        "batches, clearing their markers. A progress bar shows on a terminal. Stopped "
        "(Ctrl-C, exit 130) or failed, the same command resumes with the rows left.",
    )
    common(prune)
    log_format(prune)
    prune.add_argument("--kind", required=True, help="the rows' kind")
    prune.add_argument(
        "--older-than",
        required=True,
        type=older_than_arg,
        metavar="DURATION",
        help="age of the rows to delete: 30d, 12h, 90m, 45s or plain seconds",
    )
    prune.add_argument(
        "--batch-size",
        type=positive_int_arg,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"rows per batch (default {DEFAULT_BATCH_SIZE:,})",
    )
    return parser


def _gateway_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "redis_url": args.redis_url,
        "database_url": args.database_url,
        "data_dir": args.data_dir,
    }


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(config_path=args.config, environ=os.environ, flags=_gateway_flags(args))


def _config(args: argparse.Namespace) -> Config:
    service_flags = {
        name: getattr(args, name, None) for name in ("host", "port", "workers", "log_format")
    }
    return load_config(
        config_path=args.config,
        environ=os.environ,
        gateway_flags=_gateway_flags(args),
        service_flags=service_flags,
    )


def _serve(args: argparse.Namespace) -> int:
    from dedup.service import setup_logging
    from dedup.service.supervisor import run

    config = _config(args)
    setup_logging(config.service.log_level, config.service.log_format)
    try:
        return run(config.service, config.gateway.gateway_kwargs())
    except DedupError as exc:
        if config.service.log_format != "json":
            raise
        # A collector reading JSON lines gets the reason it stopped as one, too.
        logging.getLogger("dedup.service").error("dedup: error: %s", exc)
        return 2


_MARKS = {"ok": "OK  ", "warn": "WARN", "fail": "FAIL"}


def _check(args: argparse.Namespace) -> int:
    from dedup.cli.check import check

    findings = run(check(_config(args)))
    for f in findings:
        print(f"{_MARKS[f.status]} {f.subject:<8} {f.message}")
    failed = sum(f.status == "fail" for f in findings)
    warned = sum(f.status == "warn" for f in findings)
    if failed:
        print(f"dedup check: {failed} problem(s), {warned} warning(s)")
        return 1
    print(f"dedup check: OK ({warned} warning(s))")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from dedup.cli.demo import format_report, run_demo

    settings = _settings(args)
    for name in ("events", "values", "concurrency"):
        if getattr(args, name) < 1:
            raise DedupError(f"--{name} must be at least 1")
    if args.zipf < 0:
        raise DedupError("--zipf must be >= 0")
    kwargs = settings.gateway_kwargs()
    if kwargs["database_url"] is not None:
        kwargs["migrate"] = True
    report = run(
        run_demo(
            kwargs,
            events=args.events,
            values=args.values,
            zipf=args.zipf,
            concurrency=args.concurrency,
            seed=args.seed,
            out=sys.stdout,
        )
    )
    print(format_report(report))
    return 0 if report.passed else 1


def _migrate(args: argparse.Namespace) -> int:
    from dedup.store.migrate import current, upgrade

    settings = _settings(args)
    url = settings.database_url
    if not url:
        url = embedded_sqlite_url(settings.data_dir)
    from dedup.errors import ConfigError, Unavailable
    from dedup.urls import check_url_password, redact

    check_url_password(url, "database_url")  # else the errors could quote pieces of it
    try:
        upgrade(url)
        revision = current(url)
    except ValueError as exc:  # an unsupported URL scheme
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # unreachable or refusing: a message, not a traceback
        raise Unavailable(f"could not migrate {redact(url)}: {exc}", component="database") from None
    print(f"database {redact(url)} is at revision {revision}")
    return 0


def _logged_config(args: argparse.Namespace) -> Config:
    """The settings, with logging set up as ``serve`` does: the audit lines of a forget
    or prune (its kind and digests, never a value) go to stderr at ``log_level``."""
    from dedup.service import setup_logging

    config = _config(args)
    setup_logging(config.service.log_level, config.service.log_format)
    return config


def _forget(args: argparse.Namespace) -> int:
    from dedup.cli.forget import forget_command

    config = _logged_config(args)
    return forget_command(
        config.gateway.gateway_kwargs(), kind=args.kind, values=args.values, file=args.file
    )


def _prune(args: argparse.Namespace) -> int:
    from dedup.cli.forget import prune_command

    config = _logged_config(args)
    return prune_command(
        config.gateway.gateway_kwargs(),
        kind=args.kind,
        older_than_s=args.older_than,
        batch_size=args.batch_size,
    )


def _reconcile(args: argparse.Namespace) -> int:
    from dedup.cli.forget import reconcile_command

    config = _logged_config(args)
    return reconcile_command(config.gateway.gateway_kwargs())


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dedup.bench import bench_command, config_from_flags

    # Only explicit flags or DEDUP_* variables: the bench must not pick up a
    # config file's production URLs and flush them.
    cfg = config_from_flags(
        quick=args.quick,
        requests=args.requests,
        concurrency=args.concurrency,
        processes=args.processes,
        workloads=args.workloads,
        strategies=args.strategies,
        rate=args.rate,
        outstanding=args.outstanding,
        memory_values=args.memory_values,
        cluster=args.cluster,
    )
    redis_url = args.redis_url or os.environ.get("DEDUP_BENCH_REDIS_URL")
    database_url = args.database_url or os.environ.get("DEDUP_BENCH_DATABASE_URL")
    return bench_command(
        quick=args.quick,
        redis_url=redis_url,
        database_url=database_url,
        out_dir=Path(args.out),
        cfg=cfg,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dedup`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    commands = {
        "demo": _demo,
        "bench": _bench,
        "migrate": _migrate,
        "serve": _serve,
        "check": _check,
        "forget": _forget,
        "prune": _prune,
        "reconcile": _reconcile,
    }
    try:
        return commands[args.command](args)
    except DedupError as exc:
        print(f"dedup: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
