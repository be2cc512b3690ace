"""Throwaway certificates for ``kvpool bench remote``'s TLS case and the TLS tests, made with
the ``openssl`` command (EC P-256, valid one day; never for production): a CA, a node
certificate for 127.0.0.1 / localhost signed by it, a client certificate signed by it, and a
second, unrelated CA with a node certificate of its own (a node a client must refuse)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certs:
    ca: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_node_cert: Path
    rogue_node_key: Path


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def _ca(base: Path, name: str) -> tuple[Path, Path]:
    cert, key = base / f"{name}.pem", base / f"{name}.key"
    _openssl("req", "-x509", *_EC, "-keyout", key, "-out", cert, "-days", "1",
             "-subj", f"/CN={name}")
    return cert, key


def _signed(base: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    cert, key, csr, extfile = (base / f"{name}.pem", base / f"{name}.key",
                               base / f"{name}.csr", base / f"{name}.ext")
    extfile.write_text(ext + "\n")
    _openssl("req", *_EC, "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
             "-out", cert, "-days", "1", "-extfile", extfile)
    return cert, key


def make_certs(base: Path) -> Certs:
    """Write the certificates under ``base``. Raises OSError (FileNotFoundError without an
    ``openssl`` command) or CalledProcessError if openssl fails."""
    base.mkdir(parents=True, exist_ok=True)
    ca = _ca(base, "test-ca")
    rogue = _ca(base, "rogue-ca")
    node_ext = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"
    node = _signed(base, "node", ca, node_ext)
    client = _signed(base, "client", ca, "extendedKeyUsage=clientAuth")
    rogue_node = _signed(base, "rogue-node", rogue, node_ext)
    return Certs(ca[0], node[0], node[1], client[0], client[1], rogue[0], rogue_node[0],
                 rogue_node[1])
