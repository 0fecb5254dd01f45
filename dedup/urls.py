"""URL helpers shared by every module that shows or parses a URL: hide passwords.

:func:`redact` hides passwords in messages and logs; :func:`check_url_password`
refuses a URL whose password would split it in the wrong places; :func:`scrub`
hides the pieces of such a password that a parser's complaint may quote;
:func:`database_identity` names the database a URL reaches, without its password.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

from dedup.errors import ConfigError

__all__ = [
    "CLUSTER_SCHEMES",
    "DATABASE_SCHEMES",
    "REDIS_SCHEMES",
    "SENTINEL_SCHEMES",
    "SentinelUrl",
    "check_url_password",
    "database_identity",
    "embedded_sqlite_url",
    "parse_sentinel_url",
    "redact",
    "scrub",
]

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
# Query options of a Sentinel URL: TLS files and checks (applied to the sentinels and
# the data nodes alike), and the sentinels' own password.
_SENTINEL_QUERY = frozenset(
    ("sentinel_password", "sentinel_username", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
     "ssl_cert_reqs", "ssl_check_hostname", "ssl_ca_path")
)  # fmt: skip
DATABASE_SCHEMES = ("postgresql://", "postgres://", "sqlite:///")

# user:password@ up to the LAST @ of a non-blank run: a password with an unescaped
# "/" or "@" is hidden whole (hiding too much is the safe way to be wrong).
_URL_PASSWORD = re.compile(r"(//[^\s:/?#@]*:)[^\s]*@")
# ?password=, &ssl_password=... as redis-py and libpq read them from the query.
_QUERY_PASSWORD = re.compile(r"([?&][a-z_]*password=)[^&#\s]*", re.IGNORECASE)


def check_url_password(url: str, name: str) -> None:
    """Raise :class:`ConfigError` if ``url``'s password holds an unescaped ``/``, ``@``,
    ``?`` or ``#``.

    Such a URL splits in the wrong places, and the parsers' complaints then quote
    pieces of the password (``invalid literal for int(): '<piece>'``, ``Port could not
    be cast to integer value as '<piece>'``), which :func:`redact` cannot recognise. The
    message names neither the URL nor the password.
    """
    rest = url.partition("://")[2]
    if rest.startswith("/"):  # unix:// and sqlite:/// paths have no user part
        return
    userinfo = rest.split("?", 1)[0].rpartition("@")[0]
    # A "?" or "#" in the password ends the authority early for every parser: then an
    # "@" comes after it, still before the path (whose own "/" the password may not hold).
    head = rest.split("/", 1)[0]
    early = head.rpartition("@")[0]
    if any(c in userinfo for c in "/@#") or "?" in early or "#" in early:
        raise ConfigError(
            f"{name}: percent-encode / @ ? and # in the user name and password (%2F, %40, %3F, %23)"
        )


def redact(url: str) -> str:
    """``url`` (or a message holding URLs) with every password replaced, for messages and logs."""
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", url))


def scrub(message: str, url: str) -> str:
    """``message`` without any piece of the password of ``url``.

    A password with an unescaped ``/`` or ``@`` splits the URL in the wrong places, and
    the parser's complaint quotes a piece of it (``Port could not be cast to integer
    value as 'pw'``): every such piece of two characters or more is hidden. Not the
    same guard as :func:`check_url_password`: a password holding an unescaped ``?`` or
    ``#`` passes that check and can still be quoted by redis-py's parser.
    """
    userinfo = url.partition("://")[2].rpartition("@")[0]
    password = userinfo.partition(":")[2]
    for piece in sorted(re.split(r"[/:@?#]", password), key=len, reverse=True):
        if len(piece) >= 2:
            message = message.replace(piece, "***")
    return message


def embedded_sqlite_url(data_dir: str | Path) -> str:
    """The SQLite URL of the embedded default database under ``data_dir``."""
    return f"sqlite:///{Path(data_dir).resolve() / 'dedup.sqlite3'}"


# Hosts that name this machine: the same URL names another database on another machine.
_LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "::1", "[::1]")


def database_identity(url: str) -> str:
    """Which database ``url`` reaches, as text without its password: the scheme's family,
    the user, host, port, database and the query's options but passwords, each
    normalised (``postgres://`` is ``postgresql://``, the default port written out).

    Gateways share a writer only when their sinks' identities are equal, so two URLs
    that could reach different databases must never give one identity. A host on this
    machine (loopback, a unix socket) and a SQLite file therefore carry the machine's
    name: ``postgresql://localhost/app`` on two machines names two databases. A part the
    URL leaves out is read where asyncpg reads it: ``PGHOST`` (and ``PGSERVICE``),
    ``PGPORT``, ``PGUSER`` (else the OS user), ``PGDATABASE`` (else the user).
    """
    if url.startswith("sqlite:///"):
        path = os.path.realpath(unquote(url[len("sqlite:///") :].split("?", 1)[0]))
        return f"sqlite://{socket.gethostname()}{path}"
    parts = urlsplit(url)
    query = sorted(
        (name, value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
        if "password" not in name.lower()
    )
    # A part the URL leaves out is filled in by asyncpg (as by libpq) from the PG*
    # variables, then from its defaults: so is the identity, or two processes with one
    # URL and different environments (PGHOST=db1 / db2, say) would share a writer.
    env = os.environ
    named = dict(query)
    host = (parts.hostname or "").lower()
    if not host and "host" not in named:
        host = env.get("PGHOST", "").lower()
        if "service" not in named and env.get("PGSERVICE"):
            query.append(("service", env["PGSERVICE"]))
    socket_dir = named.get("host", "")
    if host in _LOCAL_HOSTS or host.startswith("/") or socket_dir.startswith("/"):
        host = f"{host}@{socket.gethostname()}"
    user = unquote(parts.username or "") or env.get("PGUSER", "") or _os_user()
    database = unquote(parts.path.lstrip("/")) or env.get("PGDATABASE", "") or user
    port = parts.port or env.get("PGPORT", "") or 5432
    options = "&".join(f"{name}={value}" for name, value in query)
    return f"postgresql://{user}@{host}:{port}/{database}?{options}"


def _os_user() -> str:
    """The user asyncpg connects as when neither the URL nor PGUSER names one."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container): asyncpg fails too
        return ""


class SentinelUrl(NamedTuple):
    """The parts of a ``redis+sentinel://`` URL (see :func:`parse_sentinel_url`)."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None
    tls: bool
    options: dict[str, str]
    """Query options: ``sentinel_password``, ``sentinel_username`` and ``ssl_*`` ones."""


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Read ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``
    (``rediss+sentinel://``: TLS to every node), with the sentinels' own password as
    ``?sentinel_password=``. :class:`ConfigError` for anything else; the message names
    neither the URL nor a password."""
    scheme = next((s for s in SENTINEL_SCHEMES if url.startswith(s)), None)
    if scheme is None:
        raise ConfigError(f"a Sentinel URL starts with {' or '.join(SENTINEL_SCHEMES)}")
    check_url_password(url, "redis_url")
    rest, _, query = url[len(scheme) :].partition("?")
    authority, _, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(
                "redis_url: a Sentinel URL lists its sentinels as host:port[,host:port...]"
            )
        sentinels.append((host.strip("[]"), int(port)))
    service, _, db_text = path.partition("/")
    service = unquote(service)
    if not service:
        raise ConfigError("redis_url: a Sentinel URL names its service: .../service_name[/db]")
    db_text = db_text.strip("/")
    if db_text and not db_text.isdigit():
        raise ConfigError("redis_url: a Sentinel URL's database is a number: .../service/0")
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in _SENTINEL_QUERY:
            raise ConfigError(
                f"redis_url: a Sentinel URL takes {', '.join(sorted(_SENTINEL_QUERY))} in "
                f"its query, not {name!r}"
            )
        options[name] = value
    tls = scheme.startswith("rediss")
    if not tls and any(name.startswith("ssl_") for name in options):
        raise ConfigError("redis_url: ssl_* options need rediss+sentinel://")
    return SentinelUrl(sentinels, service, int(db_text or 0), username, password, tls, options)
