"""A stand-in for the Hugging Face hub's model API, for tests of what validate asks it:
nothing here can reach huggingface.co. It answers `GET /api/models/<id>[/revision/<rev>]`
as the hub does (200 with the model's info, or 404 with the hub's RepoNotFound error
code, which huggingface_hub turns into RepositoryNotFoundError), and records each model
path it was asked, so a test can count the questions (huggingface_hub's own other
requests, such as its daily /api/agent-harnesses, get a 404 and are not recorded). Point huggingface_hub at it with
HF_ENDPOINT=hub.url."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandInHub:
    """models: the ids the hub has; None: every id asked for (a user online, where the
    example configs' models exist)."""

    def __init__(self, models: set[str] | None = None):
        self.models = models
        self.asked: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.startswith("/api/models/"):
                    hub.asked.append(self.path)
                repo = self.path.split("?")[0].removeprefix("/api/models/")
                repo = repo.split("/revision/")[0]
                if not self.path.startswith("/api/models/") or \
                        (hub.models is not None and repo not in hub.models):
                    self._answer(404, {"error": "Repository not found"},
                                 {"X-Error-Code": "RepoNotFound"})
                else:
                    self._answer(200, {"id": repo, "sha": "0" * 40, "siblings": []})

            def _answer(self, status: int, body: dict, headers: dict | None = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet: the test's output is the CLI's
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
