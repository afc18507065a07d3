"""The host's HTTP side: /metrics (Prometheus), /healthz (alive) and /readyz (serving).

/readyz answers 503 while the host starts or drains, so a load balancer or Kubernetes
readiness probe stops sending it work before it exits.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from moeless.expert_fn.host.metrics import registry_for
from moeless.expert_fn.host.runtime import ExpertHostRuntime


def start_http_endpoints(runtime: ExpertHostRuntime, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve the endpoints on host:port (0 picks a free port: read server.server_port) in a thread."""
    registry = registry_for(runtime)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                self._reply(200, b"ok\n")
            elif self.path == "/readyz":
                ready = runtime.health == "serving"
                self._reply(200 if ready else 503, f"{runtime.health}\n".encode())
            else:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: keep stderr quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http-endpoints", daemon=True).start()
    return server
