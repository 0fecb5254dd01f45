"""CPU per row of the shared writer's check of popped rows (not a test).

    .venv/bin/python bench/wire_cost.py [--rounds 2000]

Builds 100 queued rows as a claimant does (``Wire.row``) and times the writer's
``Wire.read_row`` over them, the check every popped row goes through (format, gateway,
kind, value, digest and key recomputed), in process CPU per row. No server is needed.
"""

from __future__ import annotations

import argparse
import time

from dedup._claims.keys import KeySpace
from dedup._engine.shared_wire import Wire
from dedup._values import Limits, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    rounds = parser.parse_args().rounds
    keys = KeySpace("dedup")
    wire = Wire(
        sink="0123456789abcdef",
        secret=b"",
        keys=keys,
        limits=Limits(max_value_bytes=8192, max_payload_bytes=65536),
    )
    rows = []
    for i in range(100):
        value = f"value-{i * 7919}"
        key = keys.key("k", digest(value))
        rows.append(wire.row("0123456789abcdef", i, f"tok#{i}", key, "k", value, None))
    for _ in range(3):
        started = time.process_time()
        for _ in range(rounds):
            for raw in rows:
                wire.read_row(raw)
        per_row = (time.process_time() - started) / rounds / len(rows)
        print(f"Wire.read_row: {per_row * 1e6:.2f} us CPU per row")


if __name__ == "__main__":
    main()
