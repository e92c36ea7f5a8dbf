"""A local HTTP server standing in for the Hugging Face hub (the endpoints the libraries call).

Serves model and data set repositories held in memory (``{path: bytes}``) at one fixed commit:

* ``GET /api/{models|datasets}/{id}[/revision/{rev}]`` — repository info (``sha``, ``siblings``);
* ``GET /api/{type}s/{id}/tree/{rev}[/{path}]`` — the file listing (``huggingface_hub`` and
  ``datasets`` list files with it);
* ``POST /api/{type}s/{id}/paths-info/{rev}`` — info of given paths;
* ``HEAD``/``GET /{id}/resolve/{rev}/{file}`` and ``/datasets/{id}/resolve/{rev}/{file}`` —
  the file, with the ``X-Repo-Commit`` / ``ETag`` / ``Content-Length`` headers the download code
  reads.

Unknown repositories answer 404 with ``X-Error-Code: RepoNotFound``, repositories listed in
``gated`` answer 401 with ``X-Error-Code: GatedRepo``, missing files 404 with
``X-Error-Code: EntryNotFound``, revisions other than :data:`REVISIONS` 404 with
``X-Error-Code: RevisionNotFound`` — the headers ``huggingface_hub`` turns into its error types.
``requests`` records every request line, so a test can tell whether the hub was asked at all.
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "c0ffee" + "0" * 34
REVISIONS = ("main", "v1.0", COMMIT)  # every revision names the same commit


def read_tree(root: Path) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file under ``root``."""
    return {
        str(p.relative_to(root)).replace("\\", "/"): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class FakeHub:
    """``with FakeHub(models={...}, datasets={...}) as hub: hub.url`` — serves until closed."""

    def __init__(self, models=None, datasets=None, gated=()):
        self.repos = {("model", k): v for k, v in (models or {}).items()}
        self.repos.update({("dataset", k): v for k, v in (datasets or {}).items()})
        self.gated = set(gated)
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet; requests are recorded instead
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                hub._serve(self, body=True)

        return Handler

    def _send(self, h, status, data=b"", headers=None, body=True, ctype="application/json"):
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _json(self, h, obj, body=True):
        self._send(h, 200, json.dumps(obj).encode(), body=body)

    def _serve(self, h, body: bool) -> None:
        self.requests.append(f"{h.command} {h.path}")
        path = urllib.parse.unquote(urllib.parse.urlparse(h.path).path)
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            kind = parts[1][:-1]
            repo_id = "/".join(parts[2:4])
            rest = parts[4:]
        else:
            kind = "dataset" if parts[:1] == ["datasets"] else "model"
            parts = parts[1:] if kind == "dataset" else parts
            if len(parts) < 4 or parts[2] != "resolve":
                return self._send(h, 404, body=body)
            repo_id, rest = "/".join(parts[:2]), parts[2:]
        files = self.repos.get((kind, repo_id))
        if files is None:
            return self._send(h, 404, headers={"X-Error-Code": "RepoNotFound"}, body=body)
        if repo_id in self.gated:
            return self._send(h, 401, headers={"X-Error-Code": "GatedRepo"}, body=body)
        rev = rest[1] if len(rest) > 1 and rest[0] in ("resolve", "revision", "tree") else None
        if rev is not None and rev not in REVISIONS:
            return self._send(h, 404, headers={"X-Error-Code": "RevisionNotFound"}, body=body)
        if not parts[:1] == ["api"] and rest[0] == "resolve":
            name = "/".join(rest[2:])
            if name not in files:
                return self._send(h, 404, headers={"X-Error-Code": "EntryNotFound"}, body=body)
            data = files[name]
            etag = f'"{hashlib.sha1(data).hexdigest()}"'
            headers = {"X-Repo-Commit": COMMIT, "ETag": etag}
            return self._send(h, 200, data, headers, body, "application/octet-stream")
        if not rest or rest[0] == "revision":
            return self._json(h, self._info(kind, repo_id, files), body)
        if rest[0] == "tree":
            prefix = "/".join(rest[2:])
            recursive = "recursive=true" in h.path.lower()
            entries = [
                e
                for e in self._entries(files)
                if e["path"].startswith(prefix + "/" if prefix else "")
                and (recursive or "/" not in e["path"][len(prefix) + 1 if prefix else 0 :])
            ]
            if prefix and not entries:
                return self._send(h, 404, headers={"X-Error-Code": "EntryNotFound"}, body=body)
            return self._json(h, entries, body)
        if rest[0] == "paths-info":
            wanted = set(getattr(h, "form", {}).get("paths", []))
            return self._json(h, [e for e in self._entries(files) if e["path"] in wanted], body)
        return self._send(h, 404, body=body)

    @staticmethod
    def _entries(files: dict[str, bytes]) -> list[dict]:
        out, dirs = [], set()
        for name, data in files.items():
            oid = hashlib.sha1(data).hexdigest()
            out.append({"type": "file", "path": name, "size": len(data), "oid": oid})
            parents = name.split("/")[:-1]
            dirs.update("/".join(parents[: i + 1]) for i in range(len(parents)))
        out += [{"type": "directory", "path": d, "size": 0, "oid": "0" * 40} for d in sorted(dirs)]
        return out

    def _info(self, kind, repo_id, files) -> dict:
        info = {
            "id": repo_id,
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "sha": COMMIT,
            "private": False,
            "gated": False,
            "disabled": False,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "siblings": [{"rfilename": n, "size": len(d)} for n, d in files.items()],
            "tags": [],
        }
        if kind == "dataset" and "README.md" in files:
            info["cardData"] = {}
        return info
