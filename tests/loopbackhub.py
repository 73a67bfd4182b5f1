"""A Hugging Face hub served on loopback for download tests (issue 39): the few endpoints
`huggingface_hub` calls, over a real HTTP server, so the real client code runs and nothing is
fetched from outside.

Every repo `ORG/NAME` it serves holds the files of one folder (several names, so the tests
of a module keep their downloads apart in one cache).

- `GET /api/models/ORG/NAME[/revision/REV]` (`?blobs=true`): the model info, `sha` the commit
  and `siblings` each file's size, git blob id and, for `*.safetensors`, its LFS sha256;
- `HEAD|GET /ORG/NAME/resolve/REV/FILE`: `X-Repo-Commit`, `ETag` (the git blob id, or for an LFS
  file `X-Linked-Etag` its sha256) and `X-Linked-Size`; GET honours `Range: bytes=N-` (206).

It counts the body bytes it served per (repo, file) and records each GET's start offset.
`corrupt` names (repo, file) pairs whose served bytes differ (one byte flipped) from the ones
whose hash it publishes. `gate` = (repo, file, offset): sending that file stops at `offset` until `release` is set
(`gate_reached` tells the test it got there), so a test can act at a known point of a download
without timing anything.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

COMMIT = "0f" * 20
# The hub sends a file body in pieces of this size.
SEND = 256 * 1024


class LoopbackHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos: dict[str, dict[str, bytes]] = {
            repo: {
                p.relative_to(folder).as_posix(): p.read_bytes()
                for p in sorted(folder.rglob("*"))
                if p.is_file()
            }
            for repo, folder in repos.items()
        }
        self.served: dict[tuple[str, str], int] = {}
        self.starts: dict[tuple[str, str], list[int]] = {}
        self.corrupt: set[tuple[str, str]] = set()
        self.gate: tuple[str, str, int] | None = None
        self.gate_reached = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close_gate(self, repo: str, path: str, offset: int) -> None:
        """Stop sending `path` of `repo` at `offset` until `release` is set."""
        self.release.clear()
        self.gate_reached.clear()
        self.gate = (repo, path, offset)

    def client_env(self, home: Path) -> dict[str, str]:
        """The environment a server's `huggingface_hub` needs to download from this hub into
        the Hugging Face home `home` (its cache `home/hub`), and nowhere else."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(home / "hub"),
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
        }

    def size(self, repo: str) -> int:
        return sum(len(b) for b in self.repos[repo].values())

    def total_served(self, repo: str) -> int:
        with self.lock:
            return sum(n for (r, _), n in self.served.items() if r == repo)

    def __enter__(self) -> LoopbackHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    # -- what the hub publishes -------------------------------------------------------------

    @staticmethod
    def is_lfs(path: str) -> bool:
        return path.endswith(".safetensors")

    @staticmethod
    def blob_id(data: bytes) -> str:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def etag(self, path: str, data: bytes) -> str:
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else self.blob_id(data)

    def info(self, repo: str) -> dict[str, Any]:
        siblings = []
        for path, data in self.repos[repo].items():
            sibling: dict[str, Any] = {
                "rfilename": path,
                "size": len(data),
                "blobId": self.blob_id(data),
            }
            if self.is_lfs(path):
                sibling["lfs"] = {
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            siblings.append(sibling)
        return {
            "_id": "lmsp-test",
            "id": repo,
            "modelId": repo,
            "sha": COMMIT,
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }

    def body(self, repo: str, path: str) -> bytes:
        data = self.repos[repo][path]
        if (repo, path) in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data


def _handler(hub: LoopbackHub) -> type[BaseHTTPRequestHandler]:
    info_path = re.compile(r"^/api/models/([^/]+/[^/?]+)(?:/revision/[^/?]+)?(?:\?.*)?$")
    file_path = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _not_found(self, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _file(self) -> tuple[str, str, bytes] | None:
            m = file_path.match(self.path.split("?")[0])
            if m is None or m.group(3) not in hub.repos.get(m.group(1), {}):
                return None
            return m.group(1), m.group(3), hub.body(m.group(1), m.group(3))

        def _file_headers(self, repo: str, path: str) -> None:
            # What the hub publishes, whatever bytes it then sends.
            published = hub.repos[repo][path]
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Accept-Ranges", "bytes")
            if hub.is_lfs(path):
                self.send_header("X-Linked-Etag", f'"{hub.etag(path, published)}"')
                self.send_header("X-Linked-Size", str(len(published)))
                self.send_header("ETag", f'"{hub.blob_id(published)}"')
            else:
                self.send_header("ETag", f'"{hub.etag(path, published)}"')

        def do_HEAD(self) -> None:
            found = self._file()
            if found is None:
                return self._not_found("EntryNotFound")
            repo, path, data = found
            self.send_response(200)
            self._file_headers(repo, path)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()

        def do_GET(self) -> None:
            m = info_path.match(self.path)
            if m is not None and m.group(1) not in hub.repos:
                return self._not_found("RepoNotFound")
            if m is not None:
                body = json.dumps(hub.info(m.group(1))).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            found = self._file()
            if found is None:
                return self._not_found("RepoNotFound")
            repo, path, data = found
            key = (repo, path)
            start = 0
            m = re.match(r"^bytes=(\d+)-$", self.headers.get("Range", ""))
            if m:
                start = int(m.group(1))
            with hub.lock:
                hub.starts.setdefault(key, []).append(start)
            self.send_response(206 if m else 200)
            self._file_headers(repo, path)
            if m:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            position = start
            step = SEND
            try:
                while position < len(data):
                    end = min(position + step, len(data))
                    if hub.gate is not None and hub.gate[:2] == key:
                        stop = hub.gate[2]
                        if position < stop <= end:
                            end = stop
                        elif position == stop and not hub.release.is_set():
                            hub.gate_reached.set()
                            hub.release.wait()
                    self.wfile.write(data[position:end])
                    with hub.lock:
                        hub.served[key] = hub.served.get(key, 0) + end - position
                    position = end
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler
