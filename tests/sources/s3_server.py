"""moto's S3 server mode on loopback, with a thin WSGI layer in front of moto's own app that
logs the requests (method, key, Range, bytes sent) and can hold the GET of one key after N
bytes (a `Gate`, a slow download by construction) or cut the last bytes of one key's body
(a truncated object)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import MotoRequestHandler
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

from hub_server import Gate  # noqa: F401  (same gate for both servers)


@dataclass
class S3Logged:
    method: str
    path: str
    range: Optional[str]
    bytes_sent: int = 0


class _Layer:
    def __init__(self, app, owner: "S3Server"):
        self.app = app
        self.owner = owner

    def __call__(self, environ, start_response):
        owner = self.owner
        entry = S3Logged(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE"))
        with owner.lock:
            owner.requests.append(entry)
        truncate = owner.truncate.get(entry.path) if entry.method == "GET" else None
        gate = owner.gate if entry.method == "GET" and owner.gate is not None \
            and owner.gate.path == entry.path and not owner.gate.release.is_set() else None
        if truncate is None and gate is None:
            def counted():
                for chunk in self.app(environ, start_response):
                    entry.bytes_sent += len(chunk)
                    yield chunk
            return counted()
        captured = {}

        def capture(status, headers, exc_info=None):
            captured["status"], captured["headers"] = status, headers
            return lambda data: None

        body = b"".join(self.app(environ, capture))
        if truncate is not None and captured["status"].startswith("20"):
            body = body[: max(0, len(body) - truncate)]
        headers = [(k, str(len(body)) if k.lower() == "content-length" else v) for k, v in captured["headers"]]
        start_response(captured["status"], headers)

        def held():
            if gate is not None and len(body) > gate.after_bytes:
                yield body[: gate.after_bytes]
                entry.bytes_sent += gate.after_bytes
                gate.reached.set()
                gate.release.wait(timeout=120)
                rest = body[gate.after_bytes:]
            else:
                rest = body
            yield rest
            entry.bytes_sent += len(rest)
        return held()


class S3Server(ThreadedMotoServer):
    """`ThreadedMotoServer` on 127.0.0.1 and a free port, moto's app behind `_Layer`."""

    def __init__(self):
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.requests: list[S3Logged] = []
        self.gate: Optional[Gate] = None
        self.truncate: dict[str, int] = {}  # "/bucket/key" -> bytes cut from the body
        self.lock = threading.Lock()

    def _server_entry(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log in the test output
        app = _Layer(DomainDispatcherApplication(create_backend_app), self)
        self._server = make_server(self._ip_address, self._port, app, True,
                                   request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()

    @property
    def url(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"

    def gets(self, since: int = 0, bucket: Optional[str] = None) -> list[S3Logged]:
        """Object GETs (not the listings: those carry a query string, not a key path)."""
        return [r for r in self.requests[since:] if r.method == "GET" and r.path.count("/") >= 2
                and not r.path.endswith("/") and (bucket is None or r.path.startswith(f"/{bucket}/"))]

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.release.set()
        super().stop()
