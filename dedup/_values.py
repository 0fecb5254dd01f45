"""From user input to checked values: kinds, values and payloads validated, and digests.

Every entry point (the Gateway, the middlewares, the service, shared-write queue items)
checks its input here, before any I/O, so that a bad item is refused with
:class:`dedup.errors.InvalidInput` and never reaches Redis or the database.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

import orjson

from dedup.errors import InvalidInput

__all__ = [
    "DIGEST_BYTES",
    "KIND_PATTERN",
    "MAX_KIND_CHARS",
    "Limits",
    "digest",
    "encode_payload",
    "validate_kind",
    "validate_value",
]

DIGEST_BYTES = 16
MAX_KIND_CHARS = 128


# Characters a kind may not hold: controls (C0, DEL, C1), line and paragraph
# separators, and the invisible format characters that reorder or hide text (bidi
# controls, zero-width characters, BOM), plus noncharacters. An explicit list rather
# than str.isprintable, whose answer changes with the Unicode version of each Python,
# so that every gateway of a fleet, and the OpenAPI schema, agree on what is a kind.
# Written with \uXXXX escapes, which Python's re, ECMA-262 and Rust's regex all read.
_KIND_FORBIDDEN = (
    r"\u0000-\u001f\u007f-\u009f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
    r"\u2060-\u206f\ufeff\ufff9-\ufffb\ufffe\uffff"
)
KIND_PATTERN = f"^[^{_KIND_FORBIDDEN}]+$"
"""The characters of a kind as a JSON Schema (ECMA-262) pattern; its length is checked apart."""


# Lone surrogates too: they cannot be encoded to UTF-8 (JSON cannot carry them either).
_KIND_BAD = re.compile(f"[{_KIND_FORBIDDEN}\\ud800-\\udfff]")


# A JSON ``\u0000`` escape: a backslash preceded by an even number of backslashes
# (an odd number makes it a literal backslash followed by the text "u0000").
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def digest(value: str) -> bytes:
    """The 128-bit digest of a value: the database key (with the kind) and part of the Redis key."""
    return hashlib.blake2b(value.encode(), digest_size=DIGEST_BYTES).digest()


class Limits:
    """Size limits applied to every value and payload before any work."""

    __slots__ = ("max_payload_bytes", "max_value_bytes")

    def __init__(self, *, max_value_bytes: int, max_payload_bytes: int) -> None:
        if max_value_bytes < 1 or max_payload_bytes < 2:
            raise ValueError("max_value_bytes must be >= 1 and max_payload_bytes >= 2")
        self.max_value_bytes = max_value_bytes
        self.max_payload_bytes = max_payload_bytes


def validate_kind(kind: object, index: int | None = None) -> str:
    """Return ``kind`` if it is a usable kind name, else raise :class:`InvalidInput`."""
    if type(kind) is not str:
        raise InvalidInput(
            f"kind must be a str, not {type(kind).__name__}", field="kind", index=index
        )
    if not kind or len(kind) > MAX_KIND_CHARS:
        raise InvalidInput(
            f"kind must have 1 to {MAX_KIND_CHARS} characters, got {len(kind)}",
            field="kind",
            index=index,
        )
    if _KIND_BAD.search(kind):
        raise InvalidInput(
            "kind must not hold control characters, line separators, invisible format "
            "characters (bidi, zero-width) or lone surrogates",
            field="kind",
            index=index,
        )
    return kind


def validate_value(value: object, limits: Limits, index: int | None = None) -> bytes:
    """Check a value and return its digest; raise :class:`InvalidInput` when unusable."""
    if type(value) is not str:
        raise InvalidInput(
            f"value must be a str, not {type(value).__name__}", field="value", index=index
        )
    try:
        raw = value.encode()
    except UnicodeEncodeError:
        raise InvalidInput(
            "value is not valid Unicode (lone surrogate)", field="value", index=index
        ) from None
    if len(raw) > limits.max_value_bytes:
        raise InvalidInput(
            f"value has {len(raw)} bytes, more than the limit of {limits.max_value_bytes}",
            field="value",
            index=index,
        )
    # PostgreSQL text cannot hold NUL; refusing it here keeps both sinks alike.
    if b"\x00" in raw:
        raise InvalidInput("value must not contain NUL characters", field="value", index=index)
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


def encode_payload(payload: Any, limits: Limits, index: int | None = None) -> str | None:
    """Serialise a payload to JSON text once, up front, so a bad payload fails before any work."""
    if payload is None:
        return None
    try:
        raw = orjson.dumps(payload)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise InvalidInput(
            f"payload is not JSON-serialisable: {exc}", field="payload", index=index
        ) from None
    if len(raw) > limits.max_payload_bytes:
        raise InvalidInput(
            f"payload has {len(raw)} bytes as JSON, more than the limit of "
            f"{limits.max_payload_bytes}",
            field="payload",
            index=index,
        )
    # orjson writes NaN and +-Infinity as null: refuse them rather than store
    # something else than was given. Only a payload whose JSON has a null can hold one.
    if b"null" in raw and _has_non_finite(payload):
        raise InvalidInput(
            "payload holds NaN or Infinity, which JSON cannot represent",
            field="payload",
            index=index,
        )
    # jsonb rejects the NUL escape; fail here rather than lose the batch later.
    if b"\\u0000" in raw and _NUL_ESCAPE.search(raw):
        raise InvalidInput("payload must not contain NUL characters", field="payload", index=index)
    return raw.decode()


def _has_non_finite(payload: Any) -> bool:
    """Whether a float NaN or +-Infinity is anywhere in dicts, lists and tuples of ``payload``."""
    stack = [payload]
    while stack:  # a loop, not recursion: the depth is orjson's to bound, not ours
        node = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return False
