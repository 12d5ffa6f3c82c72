"""A real HTTPS git server on 127.0.0.1 for the credential tests: `git
http-backend` behind Basic authentication, with a certificate from a test CA
(trustme), recording every request's Host and Authorization header.

The same server answers as `localhost` and as `127.0.0.1`, which git treats as
two hosts: enough to prove that a credential bound to one never reaches the
other. `/moved/<path>` redirects to the other host name.

With `lfs_objects` (oid -> content) it also serves the Git LFS batch API at
`/<repo>.git/info/lfs/objects/batch` (behind the same authentication) and the
objects at `/lfs-objects/<oid>`, counting every download in `lfs_downloads`.
"""

from __future__ import annotations

import base64
import collections
import http.server
import json
import os
import shutil
import ssl
import subprocess
import threading

import trustme


class GitHttpsServer:
    def __init__(self, project_root: str, workdir: str, accept: callable):
        """accept(username, password) -> bool decides each request's credential."""
        self.project_root = project_root
        self.requests: list[dict] = []
        self.accept = accept
        self.lfs_objects: dict[str, bytes] | None = None
        self.lfs_downloads: collections.Counter[str] = collections.Counter()
        self.lfs_sent: list[int] = []  # bytes of each object body the client took before it stopped reading
        ca = trustme.CA()
        cert = ca.issue_cert("localhost", "127.0.0.1")
        self.ca_file = os.path.join(workdir, "test-ca.pem")
        ca.cert_pem.write_to_path(self.ca_file)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(context)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 10  # a client that stalls (or never finishes its TLS handshake) is dropped

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.serve()

            def do_POST(self) -> None:
                self.serve()

            def serve(self) -> None:
                auth = self.headers.get("Authorization")
                server.requests.append({"host": self.headers.get("Host", ""), "path": self.path,
                                        "authorization": auth})
                if self.path.startswith("/moved/"):
                    other = "127.0.0.1" if self.headers.get("Host", "").startswith("localhost") else "localhost"
                    self.send_response(302)
                    self.send_header("Location", f"https://{other}:{server.port}/{self.path[len('/moved/'):]}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if server.lfs_objects is not None and self.path.startswith("/lfs-objects/"):
                    self.lfs_download(self.path[len("/lfs-objects/"):])
                    return
                user = password = None
                if auth and auth.startswith("Basic "):
                    user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
                if user is None or not server.accept(user, password):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="git"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if server.lfs_objects is not None and self.path.endswith("/info/lfs/objects/batch"):
                    self.lfs_batch(body)
                    return
                path, _, query = self.path.partition("?")
                env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": server.project_root,
                       "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path, "QUERY_STRING": query,
                       "REQUEST_METHOD": self.command, "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                       "CONTENT_LENGTH": str(len(body)), "REMOTE_USER": user,
                       "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
                       "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""), "HOME": server.project_root}
                done = subprocess.run([shutil.which("git"), "http-backend"], input=body, env=env,
                                      capture_output=True)
                head, _, payload = done.stdout.partition(b"\r\n\r\n")
                status = 200
                headers = []
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.lower() == "status":
                        status = int(value.strip().split()[0])
                    elif name:
                        headers.append((name, value.strip()))
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def lfs_batch(self, body: bytes) -> None:
                request = json.loads(body)
                host = self.headers.get("Host", "")
                objects = []
                for wanted in request.get("objects", []):
                    oid, size = wanted["oid"], wanted["size"]
                    if oid in server.lfs_objects:
                        objects.append({"oid": oid, "size": size, "authenticated": True,
                                        "actions": {"download": {"href": f"https://{host}/lfs-objects/{oid}"}}})
                    else:
                        objects.append({"oid": oid, "size": size,
                                        "error": {"code": 404, "message": "Object does not exist"}})
                self.reply(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                           "application/vnd.git-lfs+json")

            def lfs_download(self, oid: str) -> None:
                data = server.lfs_objects.get(oid)
                if data is None:
                    self.reply(404, b"", "text/plain")
                    return
                server.lfs_downloads[oid] += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                sent = 0
                try:
                    for start in range(0, len(data), 65536):
                        self.wfile.write(data[start:start + 65536])
                        sent += len(data[start:start + 65536])
                finally:
                    server.lfs_sent.append(sent)

            def reply(self, status: int, payload: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # The handshake in the handler thread, not in accept(): a client that never finishes
        # it (a killed git) must not stall the accepting thread, nor stop().
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, host: str, name: str) -> str:
        return f"https://{host}:{self.port}/{name}"

    def authorizations_to(self, host: str) -> list[str]:
        return [r["authorization"] for r in self.requests
                if r["host"].startswith(host + ":") and r["authorization"]]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
