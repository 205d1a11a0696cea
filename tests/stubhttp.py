"""The base of the tests' loopback stub servers (OpenAI-compatible endpoints, served llama-server,
vLLM or SGLang look-alikes): a quiet handler that answers JSON. Each test file's stub says only
what its server answers."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JSONHandler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def send_json(self, status: int, doc) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
