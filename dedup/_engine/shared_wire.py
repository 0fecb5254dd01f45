"""The wire format of shared writes: queued rows and the writer's answers, checked.

Anyone who can write to the namespace's Redis keys can put bytes on the queue or
publish on a gateway's channel, so nothing read from either is trusted as it
comes. Each message carries a format version, the sink it is meant for and the
claim it belongs to (the claimant gateway and a nonce of its own); a queued row is
checked as the Gateway checks a save (kind, value, payload, sizes) and its digest
and key are recomputed. With a ``shared_secret`` every message is signed (keyed
BLAKE2b, a MAC), so a client without the secret can neither insert rows nor
acknowledge saves.

A message is ``<mac>|<JSON>``; the mac is empty without a secret. A queued row has a
lease prefix before it, ``<length of the key: 2 bytes><lease key><queued token>|``,
which the writer's pop script reads to hold the row's lease as it pops it (a round
trip fewer per statement); the writer then checks the row and that the prefix is its
own, and gives back any hold it took for a row it cannot use.

Three kinds of message: a queued row (claimant to writer, on the queue), an answer
(writer to one claimant, on its channel) and the saved values of a written statement
(writer to every gateway of the sink, on one channel), from which every gateway's local
tier learns: a value saved through one process is then a local answer everywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any

import orjson

from dedup._claims.keys import KeySpace, derive_key
from dedup._values import DIGEST_BYTES, Limits, encode_payload, validate_kind, validate_value
from dedup.errors import InvalidInput
from dedup.types import Row

__all__ = ["FORMAT", "SAVED", "BadMessage", "QueuedRow", "Wire", "sign", "signed_body", "sink_id"]

FORMAT = 1
"""The version of queued rows and answers; a gateway reads only its own version."""

ANSWERS = ("i", "e", "r")
"""The writer's word per row: ``i`` inserted by its statement, ``e`` the row existed,
``r`` not written by the writer (failed, stepped down, lease gone): write it yourself."""

SAVED = "saved"
"""The addressee of a saved-values message: every gateway of the sink (never a gateway id,
which is 16 hex digits)."""

_GATEWAY_ID = re.compile(r"[0-9a-f]{16}")
_MAX_TOKEN_CHARS = 64
_MAC_BYTES = 16


class BadMessage(Exception):
    """Raised when a queued row or an answer cannot be used; ``reply_to`` names the
    claim (gateway, nonce, key) of a signed, well-formed row that this writer still
    cannot write (its claimant then writes it itself), or is None; ``lease`` is the
    lease key and queued token a queued row's prefix names (None: no readable prefix),
    so that a hold the pop took on it can be given back."""

    def __init__(
        self,
        reason: str,
        reply_to: tuple[str, int, bytes] | None = None,
        lease: tuple[bytes, str] | None = None,
    ) -> None:
        super().__init__(reason)
        self.reply_to = reply_to
        self.lease = lease


class QueuedRow:
    """One row read off the queue: whose claim it is, and the row itself."""

    __slots__ = ("gateway", "key", "nonce", "row", "token")

    def __init__(self, gateway: str, nonce: int, token: str, key: bytes, row: Row) -> None:
        self.gateway = gateway
        self.nonce = nonce
        self.token = token
        self.key = key
        self.row = row


def sink_id(identity: str, secret: bytes) -> str:
    """The name under which gateways whose sinks have ``identity`` share a writer:
    a digest, so that no URL reaches Redis key space (keyed by the secret, if any, so
    that gateways with different secrets never share)."""
    key = derive_key(secret, b"sink") if secret else b""
    return hashlib.blake2b(identity.encode(), digest_size=8, key=key).hexdigest()


class Wire:
    """Encodes and checks the messages of one sink's shared writes."""

    __slots__ = ("_gateways", "_keys", "_kinds", "_limits", "_mac_key", "sink")

    def __init__(self, *, sink: str, secret: bytes, keys: KeySpace, limits: Limits) -> None:
        self.sink = sink
        self._mac_key = derive_key(secret, b"messages") if secret else b""
        self._keys = keys
        self._limits = limits
        # Gateway ids and kinds of rows already found good: a fleet has few of each, and
        # the writer checks every row it pops (bounded, in case junk names many).
        self._gateways: set[str] = set()
        self._kinds: set[str] = set()

    # ------------------------------------------------------------- queued rows

    @property
    def key_prefix(self) -> bytes:
        """What every lease key of this namespace starts with: the only keys a pop
        script holds for a row."""
        return self._keys.prefix

    def row(
        self, gateway: str, nonce: int, token: str, key: bytes, kind: str, value: str,
        payload_json: str | None,
    ) -> bytes:  # fmt: skip
        """A queued row of claim ``(gateway, nonce)``, held under lease ``token``: the
        lease prefix, then the signed message."""
        body = orjson.dumps(
            [FORMAT, self.sink, gateway, nonce, token, key.hex(), kind, value, payload_json]
        )
        return len(key).to_bytes(2, "big") + key + token.encode() + b"|" + self._sign(body)

    def read_row(self, raw: bytes) -> QueuedRow:
        """The row in ``raw``, checked; :class:`BadMessage` when it cannot be used."""
        if not isinstance(raw, bytes) or len(raw) < 3:
            raise BadMessage("a queued row has no lease prefix")
        size = int.from_bytes(raw[:2], "big")
        key, (queued, sep, message) = raw[2 : 2 + size], raw[2 + size :].partition(b"|")
        if not size or len(key) != size or not sep or not queued:
            raise BadMessage("a queued row has no lease prefix")
        lease = (key, queued.decode("ascii", "replace"))
        try:
            row = self._read_message(message)
        except BadMessage as exc:
            exc.lease = lease
            raise
        if (row.key, row.token) != lease:
            raise BadMessage("a queued row's lease prefix is not its own", lease=lease)
        return row

    def _read_message(self, raw: bytes) -> QueuedRow:
        """The signed message of a queued row, checked."""
        fields = self._open(raw)
        if len(fields) != 9:
            raise BadMessage("a queued row has the wrong number of fields")
        _, _, gateway, nonce, token, key_hex, kind, value, payload = fields
        if type(gateway) is not str or gateway not in self._gateways:
            if not (isinstance(gateway, str) and _GATEWAY_ID.fullmatch(gateway)):
                raise BadMessage("a queued row names no gateway")
            _remember(self._gateways, gateway)
        if type(nonce) is not int or nonce < 0:
            raise BadMessage("a queued row has no nonce")
        if not (isinstance(token, str) and 0 < len(token) <= _MAX_TOKEN_CHARS):
            raise BadMessage("a queued row has no lease token")
        try:
            key = bytes.fromhex(key_hex)
        except (TypeError, ValueError):
            raise BadMessage("a queued row has no key") from None
        claim = (gateway, nonce, key)
        try:
            if type(kind) is not str or kind not in self._kinds:
                _remember(self._kinds, validate_kind(kind))
            digest = validate_value(value, self._limits)
            if payload is not None:
                if not isinstance(payload, str):
                    raise InvalidInput("payload is not JSON text", field="payload")
                payload = encode_payload(orjson.loads(payload), self._limits)
        except (InvalidInput, orjson.JSONDecodeError) as exc:
            raise BadMessage(f"a queued row is not a valid save: {exc}", claim) from None
        if self._keys.key(kind, digest) != key:
            # Another namespace layout (shards) or a forged key: never write under it.
            raise BadMessage("a queued row's key is not its value's", claim)
        return QueuedRow(gateway, nonce, token, key, Row(kind, digest, value, payload))

    # ------------------------------------------------------------- answers

    def answer(self, gateway: str, words: dict[str, list[Any]]) -> bytes:
        """The writer's word to ``gateway``: per letter of :data:`ANSWERS`, a flat list
        ``[key_hex, nonce, key_hex, nonce, ...]`` of the claims it answers."""
        body = orjson.dumps(
            [FORMAT, self.sink, gateway, *(words.get(letter, ()) for letter in ANSWERS)]
        )
        return self._sign(body)

    def read_answer(self, raw: bytes, gateway: str) -> list[tuple[str, bytes, int]]:
        """The claims an answer to ``gateway`` resolves, as ``(letter, key, nonce)``;
        :class:`BadMessage` when it cannot be used (then it resolves nothing)."""
        fields = self._open(raw)
        if len(fields) != 3 + len(ANSWERS) or fields[2] != gateway:
            raise BadMessage("an answer is not meant for this gateway")
        out: list[tuple[str, bytes, int]] = []
        for letter, flat in zip(ANSWERS, fields[3:], strict=True):
            if not isinstance(flat, list) or len(flat) % 2:
                raise BadMessage("an answer's claims are malformed")
            for i in range(0, len(flat), 2):
                key_hex, nonce = flat[i], flat[i + 1]
                if type(nonce) is not int:
                    raise BadMessage("an answer's claims are malformed")
                try:
                    out.append((letter, bytes.fromhex(key_hex), nonce))
                except (TypeError, ValueError):
                    raise BadMessage("an answer's claims are malformed") from None
        return out

    # ------------------------------------------------------------- saved values

    def saved(self, rows: list[Row]) -> bytes:
        """The values whose rows ``rows`` are committed, for every gateway's local tier:
        per kind, the digests (no value, no payload) as one hex string."""
        by_kind: dict[str, list[str]] = {}
        for row in rows:
            by_kind.setdefault(row.kind, []).append(row.digest.hex())
        flat: list[str] = []
        for kind, digests in by_kind.items():
            flat += (kind, "".join(digests))
        return self._sign(orjson.dumps([FORMAT, self.sink, SAVED, flat]))

    def read_saved(self, raw: bytes) -> list[tuple[str, list[bytes]]]:
        """The ``(kind, digests)`` of a saved-values message, checked; :class:`BadMessage`
        when it cannot be used (then nothing of it is learned)."""
        fields = self._open(raw)
        if len(fields) != 4 or fields[2] != SAVED or not isinstance(fields[3], list):
            raise BadMessage("a saved-values message is malformed")
        flat = fields[3]
        if len(flat) % 2:
            raise BadMessage("a saved-values message is malformed")
        out: list[tuple[str, list[bytes]]] = []
        for i in range(0, len(flat), 2):
            kind, digests = flat[i], flat[i + 1]
            if not isinstance(digests, str) or len(digests) % (2 * DIGEST_BYTES):
                raise BadMessage("a saved-values message has malformed digests")
            try:
                kind = validate_kind(kind)
                raw_digests = bytes.fromhex(digests)
            except (InvalidInput, ValueError):
                raise BadMessage("a saved-values message is malformed") from None
            n = DIGEST_BYTES
            out.append((kind, [raw_digests[j : j + n] for j in range(0, len(raw_digests), n)]))
        return out

    # ------------------------------------------------------------- signatures

    def _sign(self, body: bytes) -> bytes:
        return sign(body, self._mac_key)

    def _open(self, raw: object) -> list[Any]:
        """The fields of a message for this sink, its signature checked."""
        body = signed_body(raw, self._mac_key)
        try:
            fields = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise BadMessage("a message is not JSON") from None
        if not isinstance(fields, list) or len(fields) < 3:
            raise BadMessage("a message is not a list of fields")
        if type(fields[0]) is not int or fields[0] != FORMAT:
            raise BadMessage(f"a message is not of format {FORMAT}")
        if fields[1] != self.sink:
            raise BadMessage("a message is meant for another sink")
        return fields


def sign(body: bytes, key: bytes) -> bytes:
    """``body`` as a message of the fleet's channels: ``<mac>|<body>``, the mac a keyed
    BLAKE2b of the body in hex (empty without a ``key``)."""
    if not key:
        return b"|" + body
    return _mac(body, key) + b"|" + body


def signed_body(raw: object, key: bytes) -> bytes:
    """The body of a message made by :func:`sign`, its mac checked when there is a
    ``key``; :class:`BadMessage` when it is not such a message."""
    if not isinstance(raw, bytes):
        raise BadMessage("a message is not bytes")
    mac, sep, body = raw.partition(b"|")
    if not sep:
        raise BadMessage("a message has no signature field")
    if key and not hmac.compare_digest(mac, _mac(body, key)):
        raise BadMessage("a message's signature does not match (shared_secret)")
    return body


def _mac(body: bytes, key: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=_MAC_BYTES, key=key).hexdigest().encode()


def _remember(seen: set[str], item: str) -> None:
    """Add ``item`` to a set of checked names, emptied when it reaches 4,096."""
    if len(seen) >= 4096:
        seen.clear()
    seen.add(item)
