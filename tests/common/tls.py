"""Certificates made inside a test with the ``openssl`` command: a throw-away CA, a
server certificate for 127.0.0.1 / localhost and a client certificate (mutual TLS),
all signed by that CA and valid for a day.

``make_certificates(tmp_path)`` returns their paths; tests skip where ``openssl`` is
missing.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["Certificates", "make_certificates"]

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certificates:
    """PEM files: the CA's certificate, the server's and the client's key pairs."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(name: str, subject: str, extensions: str, cwd: Path) -> None:
    _openssl("req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=cwd)


def make_certificates(root: Path, server_names: str = "IP:127.0.0.1,IP:127.0.0.2,DNS:localhost") -> Certificates:
    """A CA and a server and a client certificate signed by it, under ``root``; the
    server's for ``server_names`` (its subjectAltName)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    root.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=feeder test CA", cwd=root)
    _signed("server", "/CN=localhost", f"subjectAltName={server_names}\n"
            "extendedKeyUsage=serverAuth\n", root)
    _signed("client", "/CN=feeder test client", "extendedKeyUsage=clientAuth\n", root)
    return Certificates(ca=root / "ca.pem", server_cert=root / "server.pem", server_key=root / "server.key",
                        client_cert=root / "client.pem", client_key=root / "client.key")
