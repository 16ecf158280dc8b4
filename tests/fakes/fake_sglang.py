"""A test fake of SGLang's HTTP server (a real SGLang needs a GPU, which these machines do not have).

It answers the routes eyrie uses the way SGLang v0.5.12's source says they answer
(``entrypoints/http_server.py``): ``GET /server_info`` (its settings, among them
``enable_memory_saver``, ``enable_weights_cpu_backup`` and the ``random_seed`` drawn at start),
``POST /generate`` (``meta_info``), ``POST /release_memory_occupation`` and
``/resume_memory_occupation``. Like torch_memory_saver under SGLang, it dies when asked to
release memory it already released or to resume memory it holds: a test sees that as
``died`` and a refused connection afterwards.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeSGLang:
    def __init__(
        self,
        *,
        memory_saver: bool = True,
        weights_backup: bool = True,
        seed: int = 1234,
        meta: dict | None = None,
        failures: dict[str, list[int]] | None = None,
    ) -> None:
        self.calls: list[str] = []
        self.released = False
        self.died: str | None = None
        self.failures = {path: list(codes) for path, codes in (failures or {}).items()}
        """Per route, HTTP statuses to answer before answering normally (e.g. 503: not now; 0: the
        connection is closed without an answer, as by a server that died or a network that failed)."""
        info = {"enable_memory_saver": memory_saver, "enable_weights_cpu_backup": weights_backup}
        info["random_seed"] = seed
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None: ...

            def _answer(self, status: int, answer: dict) -> None:
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _failed(self) -> bool:
                """Answers the route's next failure, if one is pending."""
                pending = fake.failures.get(self.path)
                if not pending:
                    return False
                status = pending.pop(0)
                if status:
                    self._answer(status, {"detail": "not now"})
                else:
                    self.close_connection = True
                return True

            def do_GET(self) -> None:
                fake.calls.append(self.path)
                if self._failed():
                    return
                if self.path == "/server_info":
                    self._answer(200, info)
                else:
                    self._answer(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.calls.append(self.path)
                if self._failed():
                    return
                if self.path == "/generate":
                    self._answer(
                        200, {"meta_info": {**(meta or {}), "prompt_tokens": len(body["input_ids"])}}
                    )
                elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    releasing = self.path.startswith("/release")
                    if releasing == fake.released:
                        what = (
                            "pause allocation that is not active"
                            if releasing
                            else "resume allocation that is not paused"
                        )
                        fake.die(f"Cannot {what}")
                        return
                    fake.released = releasing
                    self._answer(200, {})
                else:
                    self._answer(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def die(self, why: str) -> None:
        """As torch_memory_saver's exit(1): the server is gone, and its port refuses connections."""
        self.died = why
        self.server.socket.close()
        threading.Thread(target=self.server.shutdown, daemon=True).start()

    def close(self) -> None:
        if self.died is None:
            self.server.shutdown()
        self.server.server_close()
