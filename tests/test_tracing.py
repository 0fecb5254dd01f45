"""OpenTelemetry tracing (the ``dedup[otel]`` extra), on the real servers.

The library and the service read their spans from the SDK's in-memory exporter: this
module sets the process's global tracer provider (once: it cannot be replaced), with a
sampler that records only while a test of this module holds the ``spans`` fixture, so
that the other tests of the same worker process make no recorded spans. ``dedup serve``
as a real process exports over OTLP/HTTP to a receiver of the test's own. Without a
provider, and without the API, dedup imports nothing of OpenTelemetry (checked in
child processes, where no provider was ever set).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, StatusCode
from opentelemetry.util.types import Attributes

from dedup import Gateway, Row, Unavailable
from dedup.service.app import serve
from dedup.service.settings import ServiceSettings
from tests.servers import PostgresCluster
from tests.test_service import service_on_own_servers

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 60.0
# A caller's trace: its trace id, and the id of its span that called the service.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


# ------------------------------------------------------------------ the provider


class _Armed(Sampler):
    """Records every span while ``armed``, none otherwise."""

    armed = False

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        chosen = ALWAYS_ON if self.armed else ALWAYS_OFF
        return chosen.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return "armed by tests/test_tracing.py"


_SAMPLER = _Armed()
_EXPORTER = InMemorySpanExporter()
_provider_lock = threading.Lock()


def _global_provider() -> None:
    with _provider_lock:
        if isinstance(trace.get_tracer_provider(), TracerProvider):
            return
        provider = TracerProvider(sampler=_SAMPLER)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The in-memory exporter, empty, recording for this test only."""
    _global_provider()
    _EXPORTER.clear()
    _SAMPLER.armed = True
    try:
        yield _EXPORTER
    finally:
        _SAMPLER.armed = False
        _EXPORTER.clear()


def caller() -> Any:
    """A span of the application's own, current for the block: dedup's spans join it."""
    return trace.get_tracer("tests").start_as_current_span("caller")


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


# ------------------------------------------------------------------- the library


async def test_a_save_that_leaves_the_process_makes_a_span_a_local_one_none(
    spans: InMemorySpanExporter, redis_url: str, pg_url: str
) -> None:
    kind = "t-" + secrets.token_hex(4)
    async with Gateway(redis_url, pg_url) as one, Gateway(redis_url, pg_url) as two:
        with caller() as parent:
            first = await one.save(kind, "a@example.com")
            assert (first.created, first.source) == (True, "write")
            again = await one.save(kind, "a@example.com")
            assert again.source == "local"
            other = await two.save(kind, "a@example.com")  # the marker answers
            assert (other.created, other.source) == (False, "redis")
        # Outside any span of the caller's, dedup starts no trace of its own.
        assert (await one.save(kind, "untraced")).source == "write"
        assert (await one.save_many([(kind, "untraced-too")]))[0].created
    saves = named(spans, "dedup.save")
    assert [attrs(s) for s in saves] == [
        {
            "dedup.kind": kind,
            "dedup.source": "write",
            "dedup.created": True,
            "db.system.name": "postgresql",
        },
        {
            "dedup.kind": kind,
            "dedup.source": "redis",
            "dedup.created": False,
            "db.system.name": "redis",
        },
    ]
    assert named(spans, "dedup.save_many") == []
    for s in saves:
        assert s.parent is not None
        assert s.parent.span_id == parent.get_span_context().span_id
        assert s.kind == SpanKind.INTERNAL
        assert s.status.status_code == StatusCode.UNSET
        assert s.instrumentation_scope is not None and s.instrumentation_scope.name == "dedup"


async def test_saves_sharing_a_flight_each_make_a_span_under_the_callers_span(
    spans: InMemorySpanExporter, redis_url: str, pg_url: str
) -> None:
    kind = "t-" + secrets.token_hex(4)
    async with Gateway(redis_url, pg_url) as gw:
        with caller() as parent:
            results = await asyncio.gather(gw.save(kind, "v"), gw.save(kind, "v"))
    assert sorted(r.source for r in results) == ["inflight", "write"]
    saves = named(spans, "dedup.save")
    assert sorted(attrs(s)["dedup.source"] for s in saves) == ["inflight", "write"]
    inflight = next(s for s in saves if attrs(s)["dedup.source"] == "inflight")
    assert "db.system.name" not in attrs(inflight)  # another call's I/O answered it
    for s in saves:
        assert s.parent is not None
        assert s.parent.span_id == parent.get_span_context().span_id
        assert s.context is not None
        assert s.context.trace_id == parent.get_span_context().trace_id


async def test_save_many_makes_one_span(
    spans: InMemorySpanExporter, redis_url: str, pg_url: str
) -> None:
    kind = "t-" + secrets.token_hex(4)
    async with Gateway(redis_url, pg_url) as gw:
        await gw.save(kind, "old")
        spans.clear()
        with caller():
            results = await gw.save_many([(kind, "old"), (kind, "new-1"), (kind, "new-2")])
    assert [r.created for r in results] == [False, True, True]
    batch = named(spans, "dedup.save_many")
    assert len(batch) == 1
    assert attrs(batch[0]) == {"dedup.items": 3, "dedup.created_count": 2}
    assert named(spans, "dedup.save") == []  # the batch's items have no span each


async def test_forget_forget_many_and_prune_make_their_spans(
    spans: InMemorySpanExporter, redis_url: str, pg_url: str
) -> None:
    kind = "t-" + secrets.token_hex(4)
    async with Gateway(redis_url, pg_url) as gw:
        await gw.save_many([(kind, f"v{i}") for i in range(5)])
        spans.clear()
        with caller():
            assert await gw.forget(kind, "v0") is True
            assert await gw.forget_many([(kind, "v1"), (kind, "v2"), (kind, "never")]) == [
                True,
                True,
                False,
            ]
            await asyncio.sleep(0.05)  # the rows' created_at is the database's clock
            assert await gw.prune(kind, 0.001) == 2
    forgets = named(spans, "dedup.forget")
    assert [attrs(s) for s in forgets] == [
        {"dedup.kind": kind, "dedup.items": 1, "dedup.forgotten_count": 1},
        {"dedup.items": 3, "dedup.forgotten_count": 2},
    ]
    prunes = named(spans, "dedup.prune")
    assert [attrs(s) for s in prunes] == [{"dedup.kind": kind, "dedup.deleted_count": 2}]


async def test_a_failed_save_ends_its_span_in_error_without_a_password(
    spans: InMemorySpanExporter, redis_url: str
) -> None:
    secret = "pw-" + secrets.token_hex(6)

    async def broken_sink(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        raise RuntimeError(f"cannot reach postgresql://app:{secret}@db.internal/app")

    async with Gateway(redis_url, sink=broken_sink) as gw:
        with caller(), pytest.raises(Unavailable):
            await gw.save("t-broken", "v")
    (failed,) = named(spans, "dedup.save")
    assert failed.status.status_code == StatusCode.ERROR
    assert attrs(failed) == {"dedup.kind": "t-broken"}
    (event,) = failed.events
    assert event.name == "exception"
    event_attrs = {k: str(v) for k, v in (event.attributes or {}).items()}
    assert event_attrs["exception.type"].endswith("Unavailable")
    assert "db.internal" in event_attrs["exception.message"]
    everything = repr([attrs(failed), event_attrs, failed.status.description])
    assert secret not in everything


# -------------------------------------------------------------------- the service


@contextlib.asynccontextmanager
async def served_here(redis_url: str, pg_url: str) -> AsyncIterator[str]:
    """``serve`` in this process (so that its spans reach the in-memory exporter); its
    base URL. Stopped as a worker is, by SIGTERM (serve's handler is on this loop)."""
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    settings = ServiceSettings(port=0, drain_timeout_s=10.0)
    task = asyncio.create_task(
        serve(Gateway(redis_url, pg_url), settings, on_ready=ready.set_result)
    )
    try:
        waited: set[asyncio.Future[Any]] = {task, ready}
        done, _ = await asyncio.wait(
            waited, timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            task.result()  # raises what stopped it
        assert ready in done, "serve did not start in time"
        yield f"http://127.0.0.1:{ready.result()}"
    finally:
        if not task.done():
            os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, DEADLINE_S)


async def test_each_request_gets_a_server_span_continuing_its_traceparent(
    spans: InMemorySpanExporter, redis_url: str, pg_url: str
) -> None:
    kind = "t-" + secrets.token_hex(4)
    item = orjson.dumps({"kind": kind, "value": "a@example.com"})
    json = {"Content-Type": "application/json", "User-Agent": "tracing-test"}
    async with (
        served_here(redis_url, pg_url) as base,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as http,
    ):
        async with http.post(
            f"{base}/v1/save", data=item, headers={**json, "traceparent": TRACEPARENT}
        ) as r:
            assert r.status == 201
        async with http.post(f"{base}/v1/save", data=item, headers=json) as r:
            assert r.status == 200 and (await r.json())["source"] == "local"
        async with http.get(f"{base}/nowhere") as r:
            assert r.status == 404
    servers = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert [s.name for s in servers] == ["POST /v1/save", "POST /v1/save", "GET"]
    new, repeat, missing = servers
    port = int(base.rsplit(":", 1)[1])
    assert attrs(new) == {
        "http.request.method": "POST",
        "http.route": "/v1/save",
        "url.path": "/v1/save",
        "url.scheme": "http",
        "http.response.status_code": 201,
        "network.protocol.version": "1.1",
        "client.address": "127.0.0.1",
        "server.address": "127.0.0.1",
        "server.port": port,
        "user_agent.original": "tracing-test",
    }
    # The caller's trace goes on: the service's span is the child of its traceparent...
    assert new.context is not None and new.parent is not None
    assert f"{new.context.trace_id:032x}" == TRACE_ID
    assert f"{new.parent.span_id:016x}" == PARENT_ID and new.parent.is_remote
    # ... and the Gateway's span the child of the service's.
    (save,) = named(spans, "dedup.save")
    assert save.parent is not None and save.parent.span_id == new.context.span_id
    assert save.context is not None and save.context.trace_id == new.context.trace_id
    assert attrs(save)["dedup.source"] == "write"
    # The repeat, answered by the local tier, has its request's span and no save span;
    # without a traceparent it starts a trace of its own.
    assert attrs(repeat)["http.response.status_code"] == 200
    assert repeat.parent is None
    assert repeat.context is not None and repeat.context.trace_id != new.context.trace_id
    assert attrs(missing)["http.response.status_code"] == 404
    assert "http.route" not in attrs(missing)
    for s in servers:
        assert s.status.status_code == StatusCode.UNSET  # a 4xx is not the server's error
        assert s.start_time is not None and s.end_time is not None
        assert s.start_time <= s.end_time


# ------------------------------------------------------ dedup serve, over OTLP


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP traces endpoint that keeps what it is sent."""

    received: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/v1/traces":
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            self.server.received.append(request)  # type: ignore[attr-defined]
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    received: list[ExportTraceServiceRequest] = []
    server.received = received  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=DEADLINE_S)


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    request = urllib.request.Request(
        url,
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as answer:
        status: int = answer.status
        return status


def test_dedup_serve_exports_over_otlp_as_the_otel_variables_say(
    pg_cluster: PostgresCluster, tmp_path: Path
) -> None:
    kind = "t-" + secrets.token_hex(4)
    name = f"otel_{os.getpid()}_{secrets.token_hex(3)}"
    url = pg_cluster.create_database(name)
    with (
        otlp_receiver() as (endpoint, received),
        service_on_own_servers(
            pg_cluster,
            tmp_path,
            name,
            url,
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_SERVICE_NAME="ingest-test",
            # Sampled only where the caller's trace is: a traceparent flagged sampled.
            OTEL_TRACES_SAMPLER="parentbased_always_off",
            OTEL_BSP_SCHEDULE_DELAY="100",
        ) as (svc, _),
    ):
        traced = {"traceparent": TRACEPARENT}
        assert _post(f"{svc.url}/v1/save", {"kind": kind, "value": "in-trace"}, traced) == 201
        assert _post(f"{svc.url}/v1/save", {"kind": kind, "value": "untraced"}, {}) == 201
        # Stopped (exit 0): the worker exported what it still held.
    spans = [
        (resource.resource, span)
        for request in received
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    assert sorted(span.name for _, span in spans) == ["POST /v1/save", "dedup.save"], spans
    for resource, span in spans:
        service = {a.key: a.value.string_value for a in resource.attributes}
        assert service["service.name"] == "ingest-test"
        assert span.trace_id.hex() == TRACE_ID
    server = next(span for _, span in spans if span.name == "POST /v1/save")
    save = next(span for _, span in spans if span.name == "dedup.save")
    assert server.parent_span_id.hex() == PARENT_ID
    assert save.parent_span_id == server.span_id
    assert {a.key: a.value.string_value for a in save.attributes}["dedup.kind"] == kind


def test_dedup_serve_refuses_an_exporter_that_is_not_installed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DEDUP_"))}
    done = subprocess.run(
        [sys.executable, "-m", "dedup", "serve", "--port", "0", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env={**env, "OTEL_TRACES_EXPORTER": "console,no-such-exporter"},
    )
    assert done.returncode == 2, done.stderr
    assert "OTEL_TRACES_EXPORTER asks for 'no-such-exporter'" in done.stderr, done.stderr


# --------------------------------------------------- nothing without a provider


_CHILD = r"""
import asyncio, sys
if sys.argv[1] == "blocked":
    sys.modules["opentelemetry"] = None  # as if the API were not installed
import redis  # redis-py itself loads parts of the API and SDK when they are installed
before = {m for m in sys.modules if m.startswith("opentelemetry")}
import dedup, dedup.cli.main, dedup.service.app
from dedup import Gateway

async def main() -> None:
    async with Gateway(sys.argv[2], sys.argv[3]) as gw:
        assert (await gw.save("t-child", "v")).created
        assert (await gw.save_many([("t-child", "w")]))[0].created
        assert await gw.forget("t-child", "v")
asyncio.run(main())
after = {m for m in sys.modules if m.startswith("opentelemetry")}
print("loaded:", sorted(after - before))
"""


@pytest.mark.parametrize("api", ["blocked", "installed"])
def test_without_a_provider_dedup_loads_nothing_of_opentelemetry(
    api: str, redis_url: str, pg_url: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, api, redis_url, pg_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded: []", done.stdout
