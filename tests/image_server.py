"""Test images and a loopback HTTP server for image URLs (`http.server` in a thread).

Routes: `/img/<name>` serves a registered body (its content type from the name's suffix),
`/redirect/<n>/<name>` redirects n times before it, `/slow/<name>` sends the body a byte per
0.2 s, `/big` announces and streams 1 MiB, `/file` redirects to a `file:` URL, `/404` is 404,
`/elsewhere/<host:port>/<name>` redirects to `/img/<name>` on another server.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif"}


def image_bytes(size: tuple[int, int], fmt: str = "png", seed: int = 0) -> bytes:
    """An image of `size` with a pattern from `seed` (so two seeds differ), encoded as `fmt`."""
    image = Image.new("RGB", size)
    image.putdata([((x * 37 + seed * 91) % 256, (y * 53) % 256, seed * 17 % 256)
                   for y in range(size[1]) for x in range(size[0])])  # fmt: skip
    out = io.BytesIO()
    image.save(out, format=fmt.upper())
    return out.getvalue()


def data_url(body: bytes, fmt: str = "png") -> str:
    return f"data:{TYPES[fmt]};base64,{base64.b64encode(body).decode()}"


class _Handler(BaseHTTPRequestHandler):
    bodies: dict[str, bytes] = {}

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        parts = self.path.strip("/").split("/")
        route = getattr(self, f"_{parts[0]}", None)
        if route is None:
            self.send_error(404)
            return
        route(*parts[1:])

    def _img(self, name: str) -> None:
        body = self.bodies[name]
        self.send_response(200)
        self.send_header("content-type", TYPES.get(name.rsplit(".", 1)[-1], "image/png"))
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, n: str, name: str) -> None:
        left = int(n) - 1
        target = f"/img/{name}" if left == 0 else f"/redirect/{left}/{name}"
        self._moved(target)

    def _elsewhere(self, netloc: str, name: str) -> None:
        self._moved(f"http://{netloc}/img/{name}")

    def _file(self) -> None:
        self._moved("file:///etc/passwd")

    def _moved(self, target: str) -> None:
        self.send_response(302)
        self.send_header("location", target)
        self.send_header("content-length", "0")
        self.end_headers()

    def _slow(self, name: str) -> None:
        body = self.bodies[name]
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        for b in body:
            try:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)

    def _big(self) -> None:
        self.send_response(200)
        self.end_headers()  # NOTE: no content-length: the limit must cut the stream itself
        try:
            for _ in range(64):
                self.wfile.write(b"\0" * (16 << 10))
        except OSError:
            pass


@contextmanager
def image_server(bodies: dict[str, bytes], host: str = "127.0.0.1") -> Iterator[str]:
    """The server's base URL (`http://<host>:<port>`, a loopback host), serving `bodies` by
    name."""
    handler = type("Handler", (_Handler,), {"bodies": bodies})
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
