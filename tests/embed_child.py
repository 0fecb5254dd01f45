"""A child process for the embedding tests: ``python -m tests.embed_child JOB_FILE``.

The job is a JSON file with ``mode``, ``redis_url``, ``database_url``, ``options``
(keyword arguments of the Gateway), ``name`` and, per mode:

- ``sync_save``: ``values`` and ``threads``. Opens a :class:`dedup.SyncGateway`,
  prints ``READY``, waits for a line on stdin, saves every value from each of
  ``threads`` threads (each thread in its own shuffled order) and writes one JSON
  line per call to ``out``: ``{"value", "created", "source"}`` or ``{"value",
  "error"}``; then prints ``DONE``.
- ``once``: ``values``, ``concurrency`` and ``effects`` (a file). Opens a Gateway,
  prints ``READY``, waits for the parent's line, then calls a ``gw.once("job")``
  function for every value from ``concurrency`` coroutines; the function appends
  ``<value> <name>`` to ``effects`` (its side effect) and returns
  ``{"value", "runner"}``. Writes one JSON line per call to ``out``: ``{"value",
  "result"}`` or ``{"value", "error"}``; then prints ``DONE``.
- ``once_hold``: ``value`` and ``effects``. Calls the run-once function for
  ``value``; the function appends its side effect, prints ``RUNNING`` and then
  sleeps for good (the parent SIGKILLs the process).

The parent side is :class:`EmbedChild`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from dedup import DedupError, Gateway, SyncGateway

ROOT = Path(__file__).resolve().parent.parent
LINE_TIMEOUT_S = 60.0


def _append(path: str, line: str) -> None:
    # One write of a short line to an O_APPEND file: lines of several processes never mix.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _sync_save(job: dict[str, Any]) -> None:
    values: list[str] = job["values"]
    lines: list[str] = []
    lock = threading.Lock()
    with SyncGateway(job["redis_url"], job["database_url"], **job.get("options", {})) as gw:
        print("READY", flush=True)
        sys.stdin.readline()

        def worker(seed: int) -> None:
            mine = list(values)
            random.Random(seed).shuffle(mine)
            for value in mine:
                line: dict[str, Any]
                try:
                    r = gw.save("email", value)
                except DedupError as exc:
                    line = {"value": value, "error": repr(exc)}
                else:
                    line = {"value": value, "created": r.created, "source": r.source}
                with lock:
                    lines.append(json.dumps(line))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(job["threads"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    Path(job["out"]).write_text("".join(line + "\n" for line in lines))
    print("DONE", flush=True)


async def _once(job: dict[str, Any]) -> None:
    name: str = job["name"]
    effects: str = job["effects"]
    lines: list[str] = []
    async with Gateway(job["redis_url"], job["database_url"], **job.get("options", {})) as gw:

        @gw.once("job")
        async def work(value: str) -> dict[str, str]:
            _append(effects, f"{value} {name}")
            if job["mode"] == "once_hold":
                print("RUNNING", flush=True)
                await asyncio.sleep(3600)
            await asyncio.sleep(random.random() * 0.01)  # overlap the runs a little
            return {"value": value, "runner": name}

        if job["mode"] == "once_hold":
            await work(job["value"])
            print("UNREACHABLE", flush=True)
            return
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        values: list[str] = list(job["values"])
        random.shuffle(values)
        it = iter(values)

        async def worker() -> None:
            for value in it:
                line: dict[str, Any]
                try:
                    line = {"value": value, "result": await work(value)}
                except DedupError as exc:
                    line = {"value": value, "error": repr(exc)}
                lines.append(json.dumps(line))

        await asyncio.gather(*(worker() for _ in range(job["concurrency"])))
    Path(job["out"]).write_text("".join(line + "\n" for line in lines))
    print("DONE", flush=True)


def main() -> None:
    job: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
    if job["mode"] == "sync_save":
        _sync_save(job)
    else:
        asyncio.run(_once(job))


class EmbedChild:
    """One ``python -m tests.embed_child`` process, its stdout read line by line by a thread."""

    def __init__(self, job: dict[str, Any], files: Path) -> None:
        job_path = files.with_suffix(".job.json")
        job_path.write_text(json.dumps(job))
        self.stderr_path = files.with_suffix(".stderr")
        self._stderr: IO[bytes] = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.embed_child", str(job_path)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        for line in stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def read_line(self, timeout: float = LINE_TIMEOUT_S) -> str:
        """The next line the child prints; fails (with its stderr) on exit or timeout."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child {self.pid} printed nothing for {timeout} s") from None
        if line is None:
            self.proc.wait(timeout=LINE_TIMEOUT_S)
            self._stderr.flush()
            raise AssertionError(
                f"child {self.pid} exited with {self.proc.returncode}: "
                f"{self.stderr_path.read_text(errors='replace')[-4000:]}"
            )
        return line

    def expect(self, text: str, timeout: float = LINE_TIMEOUT_S) -> None:
        line = self.read_line(timeout)
        assert line == text, f"child {self.pid} printed {line!r}, expected {text!r}"

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL by PID if still running; reap it and close its pipes."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=LINE_TIMEOUT_S)
        self._reader.join(timeout=LINE_TIMEOUT_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(BrokenPipeError):
                    stream.close()
        self._stderr.close()


if __name__ == "__main__":
    main()
