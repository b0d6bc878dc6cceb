"""A tiny HTTP origin for lab tests: /ip returns the peer's address, /blob a fixed 1 MiB body."""

import http.server
import sys

BLOB = bytes((i * 7919) % 251 for i in range(1 << 20))


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = self.client_address[0].encode() if self.path == "/ip" else BLOB
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
