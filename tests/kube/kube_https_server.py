"""A local HTTPS server that authenticates like a Kubernetes API server, for credential tests.

It has its own CA, a server certificate (127.0.0.1 and `kubernetes.test`), and accepts a client
certificate signed by that CA (the user is the certificate's CN), a bearer token from `tokens`
or basic auth from `passwords`, as kube-apiserver does. It serves one object,
`GET /api/v1/namespaces/<ns>/configmaps/whoami`, whose `data.user` names the caller; a caller
it cannot authenticate gets a 401 Status, other paths a 404 Status. The collection
`/api/v1/namespaces/<ns>/configmaps` lists that object, and with `watch=1` streams the events
in `watch_events` (JSON lines) and ends the watch. Every Authorization header it saw is in `seen`. Certificates are made with `cryptography` (EC P-256: fast)."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import re
import ssl
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

WHOAMI = re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps/whoami$")
COLLECTION = re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps$")
SERVER_NAME = "kubernetes.test"


@dataclass
class Pem:
    cert: bytes
    key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str = "test-ca") -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return _pem(cert, key), cert, key


def issue(ca: tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey], cn: str, *, server: bool) -> Pem:
    _, ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(SERVER_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _pem(builder.sign(ca_key, hashes.SHA256()), key)


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    return Pem(cert.public_bytes(serialization.Encoding.PEM),
               key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                 serialization.NoEncryption()))


class KubeHttpsServer:
    def __init__(self, workdir: Path) -> None:
        self.ca_tuple = make_ca()
        self.ca = self.ca_tuple[0]
        self.tokens: set[str] = set()
        self.passwords: dict[str, str] = {}
        self.seen: list[Optional[str]] = []
        self.watch_events: list[dict] = []
        server_pem = issue(self.ca_tuple, "kube-apiserver", server=True)
        workdir.mkdir(parents=True, exist_ok=True)
        for name, data in (("server.crt", server_pem.cert), ("server.key", server_pem.key), ("ca.crt", self.ca.cert)):
            (workdir / name).write_bytes(data)
        self.ca_file = workdir / "ca.crt"
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(workdir / "server.crt", workdir / "server.key")
        context.load_verify_locations(self.ca_file)
        context.verify_mode = ssl.CERT_OPTIONAL  # a client certificate, or a token
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                user = fake._user(self.connection.getpeercert(), self.headers.get("Authorization"))
                path, _, query = self.path.partition("?")
                match = WHOAMI.match(path)
                collection = COLLECTION.match(path)
                if user is None:
                    self._send(401, {"kind": "Status", "status": "Failure", "reason": "Unauthorized",
                                     "message": "Unauthorized", "code": 401})
                elif collection is not None and "watch=1" in query.split("&"):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    for event in fake.watch_events:
                        self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.close_connection = True
                elif collection is not None:
                    self._send(200, {"apiVersion": "v1", "kind": "ConfigMapList", "metadata": {"resourceVersion": "7"},
                                     "items": [fake._whoami(collection.group(1), user)]})
                elif match is None:
                    self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound",
                                     "message": f"{self.path} not found", "code": 404})
                else:
                    self._send(200, {"apiVersion": "v1", **fake._whoami(match.group(1), user)})

            def _send(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _user(self, peer: Optional[dict], authorization: Optional[str]) -> Optional[str]:
        self.seen.append(authorization)
        if authorization and authorization.startswith("Bearer "):
            token = authorization[len("Bearer "):]
            return f"token:{token}" if token in self.tokens else None
        if authorization and authorization.startswith("Basic "):
            user, _, password = base64.b64decode(authorization[len("Basic "):]).decode().partition(":")
            return f"basic:{user}" if self.passwords.get(user) == password else None
        if peer:
            return "cert:" + dict(x[0] for x in peer["subject"])["commonName"]
        return None

    @staticmethod
    def _whoami(namespace: str, user: str) -> dict:
        return {"kind": "ConfigMap", "metadata": {"name": "whoami", "namespace": namespace}, "data": {"user": user}}

    def client_cert(self, cn: str) -> Pem:
        return issue(self.ca_tuple, cn, server=False)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
