"""dedup.loop.run with a progress probe: Ctrl-C stops a command even when its first
cancel is lost (Python 3.11's asyncio.wait_for, in drivers too, can swallow one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A command that swallows the first cancel (as a lost one would be) and goes on making
# progress; it would run for 60 s. Ctrl-C (SIGINT to itself) comes after a few steps.
CHILD = r"""
import asyncio, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from dedup.loop import run

done = 0
swallowed = 0

async def command() -> None:
    global done, swallowed
    while done < 600:
        try:
            await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed += 1  # lost, as asyncio.wait_for can lose one
        done += 1
        if done == 5:
            os.kill(os.getpid(), signal.SIGINT)

started = time.monotonic()
try:
    run(command(), progress=lambda: done)
except KeyboardInterrupt:
    print(f"interrupted after {done} steps, {swallowed} cancel(s) lost, "
          f"{time.monotonic() - started:.1f} s", flush=True)
    sys.exit(130)
print("ran to its end", flush=True)
"""


def test_ctrl_c_stops_a_command_whose_first_cancel_was_lost() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 130, (proc.returncode, proc.stdout, proc.stderr)
    assert "1 cancel(s) lost" in proc.stdout
    steps = int(proc.stdout.split("after ")[1].split(" steps")[0])
    assert steps < 50, proc.stdout  # stopped within a few re-cancels, not at 600
