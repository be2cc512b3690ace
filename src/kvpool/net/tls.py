"""TLS between clients and storage nodes (Python's ``ssl``): the contexts built from
``server.tls`` and ``cluster.tls``, and the socket class both sides use.

TLS is all or nothing per side: a node with ``server.tls.cert_file`` speaks only TLS, a
client with ``cluster.tls.enabled`` only TLS; neither ever falls back to plain text. A
client always verifies the node's certificate chain (against ``cluster.tls.ca_file`` or the
system CAs) and, unless ``check_hostname`` is false, its name.

Failure contract: a certificate, key or CA file that cannot be loaded raises TlsConfigError
naming the key (``kvpool serve`` exits 2 with it; a client raises it when it is built). A
handshake that fails at run time is a connection failure (TlsHandshakeError, an OSError):
the client marks the node down, the node closes that connection only.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass

from kvpool.config import ClusterTlsConfig, ServerTlsConfig
from kvpool.errors import ConfigError


class TlsConfigError(ConfigError):
    """A TLS file named in the settings cannot be used; the message names the key."""


class TlsHandshakeError(ConnectionError):
    """A TLS handshake failed (a certificate that does not verify, a peer that does not speak
    TLS, a timeout); the connection is closed."""


class TlsSocket(ssl.SSLSocket):
    """An SSLSocket whose ``shutdown`` shuts the TCP connection down and keeps the TLS
    state. ``ssl.SSLSocket.shutdown`` drops the TLS object first, so another thread that
    sends on the socket in that instant would send in plain text; here that thread's call
    fails instead (the node's sweeper and its stop shut sockets down that a lane thread is
    using)."""

    def shutdown(self, how: int) -> None:
        socket.socket.shutdown(self, how)


def _load(what: str, load: object, *args: str | None) -> None:
    try:
        load(*args)  # type: ignore[operator]
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise TlsConfigError(f"{what}: cannot load: {reason}") from None


def server_context(cfg: ServerTlsConfig) -> ssl.SSLContext:
    """The node's context: its certificate and key, and with ``client_ca_file`` a required
    client certificate signed by those CAs. Raises TlsConfigError naming the key whose file
    cannot be loaded."""
    if cfg.cert_file is None or cfg.key_file is None:
        raise TlsConfigError("server.tls.cert_file and server.tls.key_file: both needed")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # no default CAs: only client_ca_file's
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.sslsocket_class = TlsSocket
    _load(f"server.tls.cert_file={cfg.cert_file} / server.tls.key_file={cfg.key_file}",
          ctx.load_cert_chain, cfg.cert_file, cfg.key_file)
    if cfg.client_ca_file is not None:
        _load(f"server.tls.client_ca_file={cfg.client_ca_file}", ctx.load_verify_locations,
              cfg.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@dataclass(frozen=True)
class ClientTls:
    """What a client connection needs for TLS: the context and the name to check."""

    context: ssl.SSLContext
    #: Name the node's certificate must carry; None: the host the client dials.
    server_name: str | None = None

    def wrap(self, sock: socket.socket, host: str, address: str) -> ssl.SSLSocket:
        """``sock`` (connected, with the connect timeout) after a TLS handshake with the
        node at ``address``. Raises TlsHandshakeError naming the node and the reason (the
        socket is then closed)."""
        try:
            return self.context.wrap_socket(sock, server_hostname=self.server_name or host)
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            if isinstance(exc, ssl.SSLCertVerificationError):
                reason = f"certificate verify failed: {exc.verify_message}"
            else:
                reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
            raise TlsHandshakeError(f"TLS handshake with node {address} failed: {reason} "
                                    "(cluster.tls)") from None


def client_tls(cfg: ClusterTlsConfig) -> ClientTls | None:
    """The client's TLS (None when ``cluster.tls.enabled`` is false). Raises TlsConfigError
    naming the key whose file cannot be loaded."""
    if not cfg.enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.sslsocket_class = TlsSocket
    ctx.check_hostname = cfg.check_hostname
    ctx.verify_mode = ssl.CERT_REQUIRED
    if cfg.ca_file is not None:  # only these CAs, not the system's as well
        _load(f"cluster.tls.ca_file={cfg.ca_file}", ctx.load_verify_locations, cfg.ca_file)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if cfg.cert_file is not None:
        _load(f"cluster.tls.cert_file={cfg.cert_file} / cluster.tls.key_file={cfg.key_file}",
              ctx.load_cert_chain, cfg.cert_file, cfg.key_file)
    return ClientTls(ctx, cfg.server_name)
