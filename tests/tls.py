"""A throwaway certificate authority and a redis-server that speaks only TLS, for the tests.

Certificates are made at test time with the ``openssl`` command (EC P-256 keys, valid
for two days): a CA, a server certificate for ``IP:127.0.0.1`` and a client
certificate, since redis-server asks clients for one by default (``tls-auth-clients``).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

from dedup.testing.servers import RedisServer

__all__ = ["Certs", "TlsRedisServer", "make_certs"]

_OPENSSL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Certs:
    """Paths of the PEM files of one throwaway CA and the certificates it signed."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make test certificates")
    subprocess.run(
        [openssl, *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        timeout=_OPENSSL_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def _signed(folder: Path, name: str, subject: str, extensions: str) -> None:
    """``name.key`` and ``name.crt``, signed by ``ca.key`` in ``folder``."""
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(
        "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=folder
    )
    _openssl(
        "req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=folder
    )
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        cwd=folder,
    )  # fmt: skip


def make_certs(folder: Path) -> Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=folder)
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=dedup test CA", "-days", "2",
        "-out", "ca.crt", cwd=folder,
    )  # fmt: skip
    _signed(
        folder,
        "server",
        "/CN=127.0.0.1",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    _signed(folder, "client", "/CN=dedup", "extendedKeyUsage=clientAuth\n")
    for key in folder.glob("*.key"):
        key.chmod(0o600)
    return Certs(
        ca=folder / "ca.crt",
        server_cert=folder / "server.crt",
        server_key=folder / "server.key",
        client_cert=folder / "client.crt",
        client_key=folder / "client.key",
    )


class TlsRedisServer(RedisServer):
    """A private redis-server on 127.0.0.1 that listens for TLS only (``--port 0``)."""

    _name = "redis-server (TLS)"

    def __init__(self, certs: Certs, *, extra_args: Sequence[str] = ()) -> None:
        super().__init__()
        self.certs = certs
        self._more_args = list(extra_args)

    def _spawn_and_wait(self) -> None:
        # Built here, not in __init__: a retry on another free port must use that port.
        self._extra_args = [
            "--port", "0",  # later on the command line than RedisServer's --port: it wins
            "--tls-port", str(self._port),
            "--tls-cert-file", str(self.certs.server_cert),
            "--tls-key-file", str(self.certs.server_key),
            "--tls-ca-cert-file", str(self.certs.ca),
            *self._more_args,
        ]  # fmt: skip
        super()._spawn_and_wait()

    def client_context(self) -> ssl.SSLContext:
        """A client TLS context that trusts the test CA and presents the client certificate."""
        context = ssl.create_default_context(cafile=str(self.certs.ca))
        context.load_cert_chain(str(self.certs.client_cert), str(self.certs.client_key))
        return context

    def _connect(self, timeout: float) -> socket.socket:
        """The plain socket, wrapped in TLS with the test CA and client certificate."""
        raw = socket.create_connection((self.host, self._port), timeout=timeout)
        try:
            return self.client_context().wrap_socket(raw, server_hostname=self.host)
        except BaseException:
            raw.close()
            raise

    @property
    def url(self) -> str:
        """The ``rediss://`` URL, with the CA and the client certificate as query arguments."""
        query = urlencode(
            {
                "ssl_ca_certs": self.certs.ca,
                "ssl_certfile": self.certs.client_cert,
                "ssl_keyfile": self.certs.client_key,
            }
        )
        return f"rediss://{self.host}:{self._port}/0?{query}"
