"""The base of the tests' loopback stub servers (OpenAI-compatible endpoints, served llama-server,
vLLM or SGLang look-alikes): a quiet handler that answers JSON, and the server that runs it on a
free loopback port. Each test file's stub says only what its server answers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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


class StubServer:
    """`serve(Handler)` starts the stub on a free loopback port, in a daemon thread; `url` is its
    OpenAI base URL; `close()` stops it."""

    def serve(self, handler: type[BaseHTTPRequestHandler], server: type[ThreadingHTTPServer] = ThreadingHTTPServer) -> None:
        self.httpd = server(("127.0.0.1", 0), handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
