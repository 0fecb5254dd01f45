"""The OpenAPI 3.1 document of the HTTP service, served at ``GET /openapi.json``.

Built from the service's settings, so the limits it states (items per batch,
body size, whether a token is required) are the ones the running server applies.
"""

from __future__ import annotations

from typing import Any, get_args

from dedup._engine.degraded import REASONS
from dedup._values import KIND_PATTERN, MAX_KIND_CHARS
from dedup.types import Source

__all__ = [
    "BATCH_PATH",
    "ERRORS",
    "ERROR_CODES",
    "FORGET_BATCH_PATH",
    "FORGET_PATH",
    "HEALTHZ_PATH",
    "METRICS_PATH",
    "NO_NUL_PATTERN",
    "OPENAPI_PATH",
    "PATHS",
    "PROTECTED_PATHS",
    "READYZ_PATH",
    "SAVE_PATH",
    "SOURCES",
    "openapi_document",
]

# An ECMA-262 regular expression, as JSON Schema wants them.
NO_NUL_PATTERN = r"^[^\u0000]*$"
"""Text without NUL (``\\u0000``), which PostgreSQL's text and jsonb cannot hold."""

SAVE_PATH = "/v1/save"
BATCH_PATH = "/v1/save/batch"
FORGET_PATH = "/v1/forget"
FORGET_BATCH_PATH = "/v1/forget/batch"
HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"
METRICS_PATH = "/metrics"
OPENAPI_PATH = "/openapi.json"
PATHS = (
    SAVE_PATH,
    BATCH_PATH,
    FORGET_PATH,
    FORGET_BATCH_PATH,
    HEALTHZ_PATH,
    READYZ_PATH,
    METRICS_PATH,
    OPENAPI_PATH,
)
"""Every path the service answers (the document describes exactly these)."""
PROTECTED_PATHS = (SAVE_PATH, BATCH_PATH, FORGET_PATH, FORGET_BATCH_PATH, METRICS_PATH)
"""The paths that need the bearer token when one is configured."""

SOURCES: tuple[str, ...] = get_args(Source)
"""The values of ``source`` in a save's answer, in the order of :data:`dedup.types.Source`."""

ERRORS: dict[str, tuple[int | None, str]] = {
    "malformed_json": (400, "the body is not valid JSON (or not UTF-8)."),
    "malformed_http": (
        400,
        "the request is not valid HTTP/1.1 (a bad request line or header, a bad chunk "
        "size, an HTTP/1.1 request without exactly one Host, an Upgrade with a body); "
        "the connection is closed.",
    ),
    "unauthorized": (
        401,
        "a token is configured and the bearer token is missing or wrong.",
    ),
    "not_found": (404, "no such path."),
    "method_not_allowed": (405, "the path exists but not with this method (see Allow)."),
    "request_timeout": (
        408,
        "the request's head did not arrive within head_timeout_s, or its body made no "
        "progress for body_timeout_s; the connection is closed.",
    ),
    "cannot_forget": (
        409,
        "this gateway cannot erase values (approximate/Bloom mode or a custom sink); "
        "nothing was deleted.",
    ),
    "body_too_large": (413, "the body is over max_body_bytes."),
    "uri_too_long": (414, "the request target is over 8,190 bytes; the connection is closed."),
    "headers_too_large": (
        431,
        "a header is over 8,190 bytes, there are over 128 header lines, or the head is "
        "over max_head_bytes; the connection is closed.",
    ),
    "unsupported_media_type": (
        415,
        "the Content-Type is not application/json, or the body has a Content-Encoding "
        "other than identity (compressed bodies are not accepted).",
    ),
    "invalid_input": (
        422,
        "a field is missing, unknown, of the wrong type or over a limit; "
        "`field` and (in a batch) `index` name it. Nothing was saved or deleted.",
    ),
    "overloaded": (
        429,
        "this process has too many saves in flight; retry after Retry-After.",
    ),
    "internal_error": (500, "a bug; nothing was acknowledged."),
    "not_implemented": (501, "CONNECT: the service is not a proxy; the connection is closed."),
    "unavailable": (
        503,
        "Redis or the database cannot be reached (`component`); nothing was "
        "acknowledged; retry after Retry-After.",
    ),
    "wait_timeout": (
        503,
        "another writer held the value for longer than wait_timeout_s; retry after Retry-After.",
    ),
    "not_ready": (
        503,
        "the database cannot be reached (/readyz only), or the process is draining.",
    ),
    "http_version_not_supported": (
        505,
        "the request line's version is not HTTP/1.x; the connection is closed.",
    ),
    "http_error": (
        None,
        "Another 4xx raised by the HTTP layer itself (see the status); rare.",
    ),
}
"""The one table of every ``error.code`` the service sends: its status (None: any
other 4xx) and meaning. The first code listed for a status is the one an error of
the HTTP layer with that status gets."""

ERROR_CODES: dict[str, str] = {
    code: meaning if status is None else f"{status}: {meaning}"
    for code, (status, meaning) in ERRORS.items()
}
"""Every ``error.code`` the service sends, with its status and meaning."""


def _error_response(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    if retry_after:
        response["headers"] = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
    return response


def openapi_document(
    *, max_batch_items: int, max_body_bytes: int, auth: bool, version: str
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a server with these limits."""
    errors = {
        "400": {"$ref": "#/components/responses/MalformedJson"},
        "413": {"$ref": "#/components/responses/BodyTooLarge"},
        "415": {"$ref": "#/components/responses/UnsupportedMediaType"},
        "422": {"$ref": "#/components/responses/InvalidInput"},
        "429": {"$ref": "#/components/responses/Overloaded"},
        "500": {"$ref": "#/components/responses/InternalError"},
        "503": {"$ref": "#/components/responses/Unavailable"},
    }
    if auth:
        errors["401"] = {"$ref": "#/components/responses/Unauthorized"}
    kind_schema = {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_KIND_CHARS,
        "pattern": KIND_PATTERN,
        "description": "1-128 characters; no control characters, line "
        "separators, or invisible format characters (bidi, zero-width).",
    }
    value_schema = {
        "type": "string",
        "pattern": NO_NUL_PATTERN,
        "description": "No NUL; at most max_value_bytes in UTF-8.",
    }
    forget_errors = {**errors, "409": {"$ref": "#/components/responses/CannotForget"}}

    def items_of(schema: str, key: str, bound: bool) -> dict[str, Any]:
        """An object whose only field ``key`` is an array of ``schema``: a batch
        (closed, at most max_batch_items) or the answer to one."""
        array: dict[str, Any] = {"type": "array"}
        if bound:
            array["maxItems"] = max_batch_items
        array["items"] = {"$ref": f"#/components/schemas/{schema}"}
        document: dict[str, Any] = {"type": "object", "required": [key]}
        if bound:
            document["additionalProperties"] = False
        document["properties"] = {key: array}
        return document

    security: list[dict[str, list[str]]] = [{"bearer": []}] if auth else []
    request_body = f"Content-Type must be application/json; at most {max_body_bytes} bytes."
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "dedup",
            "version": version,
            "description": (
                "Write-deduplication gateway: each value of a kind is saved to the database "
                "exactly once. A 200 or 201 is sent only once the row is committed (by this "
                "request or an earlier one); any other status acknowledges nothing. Every "
                '4xx and 5xx has the body {"error": {"code", "message"}}.'
            ),
        },
        "paths": {
            SAVE_PATH: {
                "post": {
                    "operationId": "save",
                    "summary": "Save one value of a kind, once.",
                    "security": security,
                    "requestBody": {
                        "required": True,
                        "description": request_body,
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Item"}}
                        },
                    },
                    "responses": {
                        "201": {
                            "description": "This request's write inserted the row.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/SaveResult"}
                                }
                            },
                        },
                        "200": {
                            "description": "The row already existed (committed earlier).",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/SaveResult"}
                                }
                            },
                        },
                        **errors,
                    },
                }
            },
            BATCH_PATH: {
                "post": {
                    "operationId": "saveBatch",
                    "summary": "Save many values; one result per item, in order.",
                    "description": (
                        "Every item is validated before any work: one bad item gets 422 "
                        "naming its index, and nothing is saved. If a server fails midway "
                        "the request fails (503); items committed before the failure answer "
                        "created=false on retry."
                    ),
                    "security": security,
                    "requestBody": {
                        "required": True,
                        "description": request_body,
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Batch"}}
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "Every item is committed.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/BatchResult"}
                                }
                            },
                        },
                        **errors,
                    },
                }
            },
            FORGET_PATH: {
                "post": {
                    "operationId": "forget",
                    "summary": "Forget one value of a kind: delete its row and its markers.",
                    "description": (
                        "Once answered, the value is unknown everywhere: its row is deleted, "
                        "its Redis marker cleared and every gateway's local entry dropped, so "
                        "a later save of it creates it again (created=true). forgotten is "
                        "false when there was no row. Any other status deleted nothing for "
                        "sure: retrying is safe."
                    ),
                    "security": security,
                    "requestBody": {
                        "required": True,
                        "description": request_body,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ForgetItem"}
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "Done: the value is forgotten.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/ForgetResult"}
                                }
                            },
                        },
                        **forget_errors,
                    },
                }
            },
            FORGET_BATCH_PATH: {
                "post": {
                    "operationId": "forgetBatch",
                    "summary": "Forget many values; one result per item, in order.",
                    "description": (
                        "Every item is validated before any work: one bad item gets 422 "
                        "naming its index, and nothing is deleted. If a server fails midway "
                        "the request fails (503); items forgotten before the failure answer "
                        "forgotten=false on retry."
                    ),
                    "security": security,
                    "requestBody": {
                        "required": True,
                        "description": request_body,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ForgetBatch"}
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "Every item is forgotten.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/ForgetBatchResult"}
                                }
                            },
                        },
                        **forget_errors,
                    },
                }
            },
            HEALTHZ_PATH: {
                "get": {
                    "operationId": "healthz",
                    "summary": "The process is alive (checks nothing else).",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "Alive.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/Health"}
                                }
                            },
                        }
                    },
                }
            },
            READYZ_PATH: {
                "get": {
                    "operationId": "readyz",
                    "summary": "The database answers: this process can serve.",
                    "description": (
                        "`degraded` is true while Redis is skipped (down or slow: the circuit "
                        "is open) and saves go through the database's unique key alone; "
                        "`reason` says why (unreachable, oom, readonly or misconf); "
                        "`checks` tells which server answered."
                    ),
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "Ready.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/Ready"}
                                }
                            },
                        },
                        "503": _error_response(
                            "Not ready (code not_ready; `checks` says which server failed), "
                            "or draining after SIGTERM.",
                            retry_after=True,
                        ),
                    },
                }
            },
            METRICS_PATH: {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus text exposition (format 0.0.4) of the whole service.",
                    "security": security,
                    "responses": {
                        "200": {
                            "description": "Metrics.",
                            "content": {
                                "text/plain; version=0.0.4": {"schema": {"type": "string"}}
                            },
                        },
                        **({"401": errors["401"]} if auth else {}),
                    },
                }
            },
            OPENAPI_PATH: {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document.",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "The OpenAPI document.",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "Item": {
                    "type": "object",
                    "required": ["kind", "value"],
                    "additionalProperties": False,
                    "properties": {
                        "kind": kind_schema,
                        "value": value_schema,
                        "payload": {
                            "$ref": "#/components/schemas/Json",
                            "description": "Any JSON (stored with the row the first time); "
                            "null means none. At most max_payload_bytes as JSON.",
                        },
                    },
                },
                "Json": {
                    "description": "Any JSON without NUL characters (PostgreSQL's jsonb "
                    "refuses them). Numbers are read as 64-bit integers or doubles: a larger "
                    "integer is stored as the nearest double.",
                    "anyOf": [
                        {"type": ["null", "boolean", "number"]},
                        {"type": "string", "pattern": NO_NUL_PATTERN},
                        {"type": "array", "items": {"$ref": "#/components/schemas/Json"}},
                        {
                            "type": "object",
                            "propertyNames": {"pattern": NO_NUL_PATTERN},
                            "additionalProperties": {"$ref": "#/components/schemas/Json"},
                        },
                    ],
                },
                "Batch": items_of("Item", "items", bound=True),
                "SaveResult": {
                    "type": "object",
                    "required": ["created", "source"],
                    "properties": {
                        "created": {
                            "type": "boolean",
                            "description": "True only for the save whose own write inserted "
                            "the row (exactly when source is write).",
                        },
                        "source": {
                            "type": "string",
                            "enum": list(SOURCES),
                        },
                    },
                },
                "BatchResult": items_of("SaveResult", "results", bound=False),
                "ForgetItem": {
                    "type": "object",
                    "required": ["kind", "value"],
                    "additionalProperties": False,
                    "properties": {
                        "kind": kind_schema,
                        "value": value_schema,
                    },
                },
                "ForgetBatch": items_of("ForgetItem", "items", bound=True),
                "ForgetResult": {
                    "type": "object",
                    "required": ["forgotten"],
                    "additionalProperties": False,
                    "properties": {
                        "forgotten": {
                            "type": "boolean",
                            "description": "True when this call deleted the value's row; "
                            "false when there was none (never saved, or already forgotten).",
                        }
                    },
                },
                "ForgetBatchResult": items_of("ForgetResult", "results", bound=False),
                "Health": {
                    "type": "object",
                    "required": ["status", "pid"],
                    "properties": {
                        "status": {"const": "ok"},
                        "pid": {"type": "integer", "description": "The worker process."},
                    },
                },
                "Ready": {
                    "type": "object",
                    "required": ["ready", "degraded", "checks"],
                    "properties": {
                        "ready": {"const": True},
                        "degraded": {"type": "boolean"},
                        "reason": {
                            "description": "Why Redis is skipped (only while degraded).",
                            "enum": list(REASONS),
                        },
                        "checks": {"$ref": "#/components/schemas/Checks"},
                    },
                },
                "Checks": {
                    "type": "object",
                    "properties": {"redis": {"type": "boolean"}, "database": {"type": "boolean"}},
                },
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message"],
                            "properties": {
                                "code": {"type": "string", "enum": sorted(ERROR_CODES)},
                                "message": {"type": "string"},
                                "field": {
                                    "type": ["string", "null"],
                                    "description": "invalid_input: the offending field.",
                                },
                                "index": {
                                    "type": "integer",
                                    "description": "invalid_input in a batch: the item.",
                                },
                                "component": {
                                    "type": "string",
                                    "enum": ["redis", "database"],
                                    "description": "unavailable: the server that failed.",
                                },
                                "checks": {"$ref": "#/components/schemas/Checks"},
                            },
                        }
                    },
                },
            },
            "headers": {
                "Retry-After": {
                    "description": "Seconds to wait before retrying.",
                    "schema": {"type": "integer", "minimum": 1},
                }
            },
            "responses": {
                "MalformedJson": _error_response("malformed_json: the body is not JSON."),
                "Unauthorized": _error_response("unauthorized: bearer token missing or wrong."),
                "BodyTooLarge": _error_response(
                    f"body_too_large: the body is over {max_body_bytes} bytes."
                ),
                "UnsupportedMediaType": _error_response(
                    "unsupported_media_type: Content-Type is not application/json, or "
                    "Content-Encoding is not identity."
                ),
                "InvalidInput": _error_response(
                    "invalid_input: which field (and item index) and why; nothing was saved "
                    "or deleted."
                ),
                "Overloaded": _error_response(
                    "overloaded: too many saves in flight in this process.", retry_after=True
                ),
                "CannotForget": _error_response(
                    "cannot_forget: this gateway cannot erase values (approximate/Bloom mode "
                    "or a custom sink); nothing was deleted."
                ),
                "InternalError": _error_response("internal_error: nothing was acknowledged."),
                "Unavailable": _error_response(
                    "unavailable (Redis or the database cannot be reached) or wait_timeout "
                    "(another writer held the value too long); nothing was acknowledged.",
                    retry_after=True,
                ),
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "x-error-codes": ERROR_CODES,
    }
