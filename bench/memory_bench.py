"""Redis bytes per saved value for each marker layout, through the real scripts.

    .venv/bin/python bench/memory_bench.py [--values 1000000] [--batch 512]
        [--layouts compact,compact-128,compact-retention,keys,approximate]
        [--buckets 65536] [--fp-rate 0.01]

A thin script over :mod:`dedup.bench.memory`, which ``dedup bench`` uses too (for
``compact``, ``keys`` and ``approximate``, with ``marker_buckets`` scaled to the values
below 1M). For each layout a throwaway redis-server is started, and ``--values``
distinct values are claimed and committed in batches of ``--batch`` by
:class:`dedup._claims.protocol.Claims` (the claim and commit scripts the gateway runs). Printed
per layout: ``used_memory`` (INFO memory) after minus before, per saved value; the
keys Redis holds; claims+commits per second; duplicate claims per second (a sample of
saved values claimed again: all answer "saved"); and the Redis CPU time in the scripts
(INFO commandstats) per saved value (claim + commit) and per duplicate claim.

Layouts (``dedup.bench.memory.LAYOUTS``): ``compact`` (``hash-max-listpack-entries
512`` as in config/redis.conf), ``compact-128`` (Redis's own default of 128, where
buckets that outgrow it turn into hash tables), ``compact-retention`` (a one-day
retention), ``keys`` (one key per value, the layout before compact markers) and
``approximate`` (``bloom`` is accepted too: the Bloom filter sized for ``--values`` at
``--fp-rate``, its false-positive rate measured on up to 100,000 new values, claimed
then aborted).

Not a test: figures depend on the Redis version and allocator (jemalloc here).
"""

from __future__ import annotations

import argparse
import sys

from dedup.bench.memory import LAYOUTS, measure_layout
from dedup.loop import run as run_loop

ALIASES = {"bloom": "approximate"}  # its name before the bench measured it too


async def main(args: argparse.Namespace) -> None:
    print(
        f"{'layout':<12} {'values':>10} {'bytes/value':>11} {'keys':>9} {'saves/s':>9} "
        f"{'dup claims/s':>12} {'Redis us/save':>13} {'Redis us/dup':>12}  notes",
        flush=True,
    )
    for name in args.layouts.split(","):
        row = await measure_layout(
            name, args.values, batch=args.batch, buckets=args.buckets, fp_rate=args.fp_rate
        )
        notes = ""
        if name == "approximate":
            notes = (
                f"fp measured {row['fp_measured']:.4f} vs configured {row['fp_configured']} "
                f"(m={row['bloom_m_k'][0]}, k={row['bloom_m_k'][1]}; the bitmaps alone: "
                f"{row['bloom_bytes_per_value']:.2f} bytes/value (MEMORY USAGE); "
                f"{row['values'] - row['committed']} false positives while filling)"
            )
        elif row["dup_answers_saved"] != 1.0:
            notes = f"only {row['dup_answers_saved']:.4f} of saved values answered saved!"
        print(
            f"{row['layout']:<12} {row['values']:>10} {row['bytes_per_value']:>11.2f} "
            f"{row['keys']:>9} {row['saves_per_s']:>9.0f} {row['dup_claims_per_s']:>12.0f} "
            f"{row['redis_us_per_save']:>13.2f} {row['redis_us_per_dup']:>12.2f}  "
            f"{notes}",
            flush=True,
        )


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument(
        "--layouts", default="compact,compact-128,compact-retention,keys,approximate"
    )
    parser.add_argument("--buckets", type=int, default=65536, help="marker_buckets")
    parser.add_argument("--fp-rate", type=float, default=0.01)
    args = parser.parse_args(argv)
    args.layouts = ",".join(ALIASES.get(x, x) for x in args.layouts.split(","))
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts: {', '.join(sorted(unknown))}")
    return args


if __name__ == "__main__":
    run_loop(main(parse(sys.argv[1:])))
