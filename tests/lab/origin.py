"""A tiny HTTP origin for lab tests: /ip returns the peer's address, /blob a fixed 1 MiB body,
/stream 64 MiB (the blob repeated: a long download whose connection stays open while a client reads slowly);
POST anything: the body is read and dropped, and its length answered (uploads of a known size)."""

import http.server
import sys

BLOB = bytes((i * 7919) % 251 for i in range(1 << 20))


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("content-length", str(64 * len(BLOB)))
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(BLOB)
            except OSError:
                pass  # the client stopped reading (its time limit)
            return
        body = self.client_address[0].encode() if self.path == "/ip" else BLOB
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        left = int(self.headers.get("content-length") or 0)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)
        body = str(int(self.headers.get("content-length") or 0) - left).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
