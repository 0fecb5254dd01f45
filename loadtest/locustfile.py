"""Locust users for the HTTP service (``dedup serve``): single-item saves and batches.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8080 --headless -u 64 -r 64 -t 30s

Two users, both closed loops (no wait between requests), values drawn from Zipf(s) over
``DEDUP_LOAD_VALUES`` values (see ``workload.py`` for every setting):

- ``SingleSaveUser``: ``POST /v1/save`` with one item;
- ``BatchSaveUser``: ``POST /v1/save/batch`` with ``DEDUP_LOAD_BATCH`` items (the batch's
  requests/s times the batch size is its items/s).

Weights come from ``DEDUP_LOAD_SINGLE_WEIGHT`` / ``DEDUP_LOAD_BATCH_WEIGHT``; a user class
named on the command line (``... BatchSaveUser``) runs alone. When ``DEDUP_AUTH_TOKEN`` is
set every request carries ``Authorization: Bearer <token>``.

A request counts as a failure unless its status is 2xx and its JSON body holds ``created``
(for a batch: one result with ``created`` per item sent). Everything else (429, 503, a
connection error, a malformed body) is a failure with the status and error code as its
message, so locust's failure table says what went wrong.
"""

from __future__ import annotations

import json
import os
from typing import Any

from locust import FastHttpUser, constant, events, task
from locust.env import Environment
from workload import (
    BATCH,
    BATCH_WEIGHT,
    KIND,
    SINGLE_WEIGHT,
    GracefulStop,
    ZipfValues,
    recorder,
)

_TOKEN = os.environ.get("DEDUP_AUTH_TOKEN", "")
HEADERS = {"Content-Type": "application/json"}
if _TOKEN:
    HEADERS["Authorization"] = f"Bearer {_TOKEN}"


def _why(status: int, body: Any) -> str:
    """A short failure message: the status and the service's error code, never the token."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"HTTP {status} {body['error'].get('code')}"
    return f"HTTP {status}"


def _decode(content: bytes | None) -> Any:
    try:
        return json.loads(content or b"")
    except ValueError:
        return None


class SingleSaveUser(GracefulStop, FastHttpUser):
    """``POST /v1/save``, one Zipf-drawn value per request."""

    weight = SINGLE_WEIGHT
    wait_time = constant(0)

    def on_start(self) -> None:
        self.values = ZipfValues()

    @task
    def save(self) -> None:
        value = self.values.one()
        body = json.dumps({"kind": KIND, "value": value})
        with self.client.post(
            "/v1/save", data=body, headers=HEADERS, catch_response=True, name="/v1/save"
        ) as resp:
            answer = _decode(resp.content)
            if 200 <= resp.status_code < 300 and isinstance(answer, dict) and "created" in answer:
                resp.success()
                recorder.add(value, answer["created"] is True)
            else:
                resp.failure(_why(resp.status_code, answer))


class BatchSaveUser(GracefulStop, FastHttpUser):
    """``POST /v1/save/batch``, ``DEDUP_LOAD_BATCH`` Zipf-drawn values per request."""

    weight = BATCH_WEIGHT
    wait_time = constant(0)

    def on_start(self) -> None:
        self.values = ZipfValues()

    @task
    def save_batch(self) -> None:
        values = self.values.draw(BATCH)
        body = json.dumps({"items": [{"kind": KIND, "value": v} for v in values]})
        with self.client.post(
            "/v1/save/batch", data=body, headers=HEADERS, catch_response=True, name="/v1/save/batch"
        ) as resp:
            answer = _decode(resp.content)
            results = answer.get("results") if isinstance(answer, dict) else None
            if (
                200 <= resp.status_code < 300
                and isinstance(results, list)
                and len(results) == len(values)
                and all(isinstance(r, dict) and "created" in r for r in results)
            ):
                resp.success()
                for value, result in zip(values, results, strict=True):
                    recorder.add(value, result["created"] is True)
            else:
                resp.failure(_why(resp.status_code, answer))


def _write_record(environment: Environment, **_: Any) -> None:
    # Users are stopped by now (with --stop-timeout, each finished its request), so the
    # record holds every answer this process received.
    recorder.flush()


events.quitting.add_listener(_write_record)  # type: ignore[no-untyped-call]
