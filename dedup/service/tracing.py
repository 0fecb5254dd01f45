"""Tracing in ``dedup serve``: the OpenTelemetry SDK set up from the standard ``OTEL_*``
variables, and one server span per request.

:func:`configure` starts tracing in a worker when the ``dedup[otel]`` extra is installed
and the environment asks for traces: ``OTEL_TRACES_EXPORTER`` names an exporter
(``otlp``, ``console``, or any installed one), or ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (then ``otlp``). ``otlp`` is OTLP over HTTP
with protobuf unless ``OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL`` asks for ``grpc``. The rest
is the SDK's own reading of the environment: ``OTEL_TRACES_SAMPLER`` and
``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (the
service name is ``dedup`` when neither names one), ``OTEL_PROPAGATORS``, the exporter's
``OTEL_EXPORTER_OTLP_*`` and the batch processor's ``OTEL_BSP_*``. ``OTEL_SDK_DISABLED=true``
or ``OTEL_TRACES_EXPORTER=none`` leave it off. Without such a variable nothing is set up
(and nothing is exported to a collector that is not there).

:func:`server_span` and :func:`end_server_span` make a request's span as the HTTP
semantic conventions describe a server's: named ``POST /v1/save`` (method and route),
kind SERVER, a child of the span of an incoming W3C ``traceparent`` (through the global
propagator), with ``http.request.method``, ``http.route``, ``url.path``, ``url.scheme``,
``http.response.status_code``, ``network.protocol.version``, ``server.address``,
``server.port``, ``client.address``, ``user_agent.original``, and ``error.type`` with the
status ERROR for a 5xx. Called only while a tracer is active (:func:`dedup.tracing.active_tracer`):
with tracing off a request costs one check.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dedup.errors import ConfigError
from dedup.service.messages import Request, Response

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

__all__ = ["configure", "continues_a_trace", "end_server_span", "server_span", "wanted"]

log = logging.getLogger("dedup.service")

_EXPORTER_GROUP = "opentelemetry_traces_exporter"
_OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
# The samplers that never record a trace begun here: with them a request that brings no
# trace of its caller's is not traced, and costs no span (one the sampler would drop
# costs about 4 µs with the SDK, a repeat's whole answer 10 to 20 µs).
_DROP_ROOTS = frozenset(("always_off", "parentbased_always_off"))
roots_dropped = False
"""True once :func:`configure` set a sampler up that drops every trace begun here:
only the requests that continue a caller's trace get a span then."""
_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)


def wanted(environ: Mapping[str, str]) -> list[str]:
    """The exporters ``environ`` asks for (entry point names), empty when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not names and (
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        names = "otlp"
    exporters: list[str] = []
    for raw in names.split(","):
        name = raw.strip().lower()
        if name in ("", "none"):
            continue
        if name == "otlp":
            protocol = (
                environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf"
            ).strip()
            if protocol not in _OTLP_BY_PROTOCOL:
                raise ConfigError(
                    f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not supported "
                    "(http/protobuf or grpc)"
                )
            name = _OTLP_BY_PROTOCOL[protocol]
        exporters.append(name)
    return exporters


def configure(environ: Mapping[str, str] = os.environ) -> Callable[[], None] | None:
    """Set the global tracer provider up from ``environ`` (see the module's docstring);
    returns its shutdown (which exports the spans still batched), or None when tracing
    stays off. Raises :class:`ConfigError` for an exporter that is not installed."""
    names = wanted(environ)
    if not names:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "OTEL_* asks for traces, but the OpenTelemetry SDK is not installed "
            "(pip install 'dedup[otel]'): no traces"
        )
        return None
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None  # the process has its provider already: dedup's spans go there
    exporters = [_exporter(name) for name in names]
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "dedup"}))
    provider = TracerProvider(resource=resource)  # its sampler: OTEL_TRACES_SAMPLER
    global roots_dropped
    roots_dropped = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() in _DROP_ROOTS
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing: exporting spans with %s", ", ".join(names))
    return provider.shutdown


def _exporter(name: str) -> SpanExporter:
    from importlib.metadata import entry_points

    found = list(entry_points(group=_EXPORTER_GROUP, name=name))
    if not found:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER asks for {name!r}, which is not installed "
            "(otlp comes with dedup[otel]; console with the SDK)"
        )
    exporter: SpanExporter = found[0].load()()
    return exporter


def _start_ns(request: Request) -> int:
    """The request's start (its head's first byte) on the wall clock, in ns."""
    return time.time_ns() - int((time.perf_counter() - request.started) * 1e9)


def _host_port(host: str) -> tuple[str, int | None]:
    name, sep, port = host.rpartition(":")
    if not sep or "]" in port:  # no port, or an IPv6 literal without one
        return host.strip("[]"), None
    return name.strip("[]"), int(port) if port.isdigit() else None


# Made once per (method, route) of the service's own paths: a span's name and the
# attributes given at its start (for the sampler), shared by every request that has them.
_NAMED: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
# The global propagator, and the header names it reads (a request with none of them has
# nothing to extract: the usual request costs no call of the propagator).
_PROPAGATOR: tuple[Any, frozenset[str]] = (None, frozenset())


def _name_and_attributes(request: Request, route: str | None) -> tuple[str, dict[str, Any]]:
    method = request.method if request.method in _METHODS else "_OTHER"
    if route is not None:
        named = _NAMED.get((method, route))
        if named is not None:
            return named
    name = method if method != "_OTHER" else "HTTP"
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "url.path": request.path,
        "url.scheme": "http",
    }
    if method == "_OTHER":
        attributes["http.request.method_original"] = request.method
    elif route is not None:  # _OTHER's original method varies: not kept
        attributes["http.route"] = route
        _NAMED[(method, route)] = (f"{name} {route}", attributes)
        return _NAMED[(method, route)]
    if route is not None:
        name = f"{name} {route}"
        attributes["http.route"] = route
    return name, attributes


# The API's modules, imported at the first span (never while tracing is off).
_propagate: Any = None
_SERVER: Any = None  # SpanKind.SERVER


def _load() -> None:
    global _propagate, _SERVER
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    _propagate, _SERVER = propagate, SpanKind.SERVER


def _fields() -> frozenset[str]:
    """The header names the global propagator reads (``traceparent``, ``tracestate``,
    ``baggage`` by default), kept while the propagator stays the same."""
    global _PROPAGATOR
    if _propagate is None:
        _load()
    propagator = _propagate.get_global_textmap()
    if _PROPAGATOR[0] is not propagator:
        _PROPAGATOR = (propagator, frozenset(field.lower() for field in propagator.fields))
    return _PROPAGATOR[1]


def continues_a_trace(headers: Mapping[str, str]) -> bool:
    """Whether a request gets a span: always, unless the sampler drops every trace
    begun here (:data:`roots_dropped`); then only when it brings its caller's."""
    if not roots_dropped:
        return True
    for field in _fields():  # noqa: SIM110 (a loop, not any(): no generator per request)
        if field in headers:
            return True
    return False


def _parent(headers: Mapping[str, str]) -> Any:
    """The context of the caller's span (a W3C ``traceparent`` with the default
    propagators), or None (a trace of its own) when no header the propagator reads is here."""
    for field in _fields():
        if field in headers:
            return _propagate.extract(headers)
    return None


def server_span(tracer: Tracer, request: Request, route: str | None) -> Span:
    """A started SERVER span for ``request`` (``route``: its known path, else None),
    begun when its head began, the child of an incoming ``traceparent``."""
    if _SERVER is None:
        _load()
    name, attributes = _name_and_attributes(request, route)
    return tracer.start_span(
        name,
        context=_parent(request.headers),
        kind=_SERVER,
        attributes=attributes,
        start_time=_start_ns(request),
        record_exception=False,
        set_status_on_exception=False,
    )


def end_server_span(span: Span, request: Request, response: Response) -> None:
    """End a request's span with its answer."""
    if span.is_recording():
        from opentelemetry.trace import Status, StatusCode

        headers = request.headers
        status = response.status
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("network.protocol.version", request.version)
        span.set_attribute("client.address", request.remote)
        host = headers.get("host")
        if host:
            address, port = _host_port(host)
            span.set_attribute("server.address", address)
            if port is not None:
                span.set_attribute("server.port", port)
        agent = headers.get("user-agent")
        if agent is not None:
            span.set_attribute("user_agent.original", agent)
        if status >= 500:  # a 4xx is the client's error, not the server's (semconv)
            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR))
    span.end()
