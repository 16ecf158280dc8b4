"""A small HTTP server for services' tests: ``python server.py PORT [START_DELAY_S]``.

It listens on every address (a container is reached from outside it). ``/health`` answers 200
once it listens (after ``START_DELAY_S``); ``/`` answers its pid, so a test sees which replica,
and which start of it, answered.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"pid": os.getpid(), "path": self.path}).encode()
        self.send_response(200 if self.path in ("/", "/health") else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's name
        pass


if __name__ == "__main__":
    port = int(sys.argv[1])
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)  # noqa: S104 - reached from other containers
    server.allow_reuse_address = True
    print(f"serving on {port}", flush=True)
    server.serve_forever()
