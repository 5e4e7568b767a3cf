"""A fake Kubernetes API server (HTTP, in a thread) serving only what gemini-scheduler calls:

    GET   /api/v1/namespaces/{ns}/pods/{name}
    POST  /api/v1/namespaces/{ns}/events
    GET   /api/v1/nodes/{name}
    PATCH /api/v1/nodes/{name}        merge or strategic-merge patch of metadata.labels

Objects are built with the official client's models and serialized by its ApiClient, so the
daemon's client parses exactly what a real API server would send. Every request is recorded
(`requests`, `events`, `patches`) for the tests to assert on. Anything else is a 404 Status.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client as k8s

_api: Any = k8s.ApiClient()
_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
_NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeApiServer:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.patches: list[tuple[str, str, dict[str, Any]]] = []   # node, content type, body
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.fail_all = False    # answer 503 to everything (API server away)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

            def do_PATCH(self) -> None:
                fake._handle(self, "PATCH")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- objects ----

    def add_pod(self, namespace: str, name: str, uid: str,
                annotations: dict[str, str] | None = None) -> None:
        pod = k8s.V1Pod(api_version="v1", kind="Pod", metadata=k8s.V1ObjectMeta(
            name=name, namespace=namespace, uid=uid, annotations=annotations or {}))
        with self.lock:
            self.pods[(namespace, name)] = _api.sanitize_for_serialization(pod)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        node = k8s.V1Node(api_version="v1", kind="Node",
                          metadata=k8s.V1ObjectMeta(name=name, labels=labels or {}),
                          status=k8s.V1NodeStatus(capacity={}, allocatable={}))
        with self.lock:
            self.nodes[name] = _api.sanitize_for_serialization(node)

    def set_node_resources(self, name: str, capacity: dict[str, str],
                           allocatable: dict[str, str]) -> None:
        """What kubelet's node status updater would post."""
        with self.lock:
            status = self.nodes[name].setdefault("status", {})
            status["capacity"], status["allocatable"] = dict(capacity), dict(allocatable)

    def node(self, name: str) -> dict[str, Any]:
        with self.lock:
            copy: dict[str, Any] = json.loads(json.dumps(self.nodes[name]))
            return copy

    def events_for(self, namespace: str, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e["involvedObject"]["namespace"] == namespace
                    and e["involvedObject"]["name"] == name]

    # ---- HTTP ----

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        path = request.path.split("?", 1)[0]
        length = int(request.headers.get("Content-Length") or 0)
        raw = request.rfile.read(length) if length else b""
        with self.lock:
            self.requests.append((method, path))
            code, answer = self._answer(method, path, raw,
                                        request.headers.get("Content-Type", ""))
        body = json.dumps(answer).encode()
        request.send_response(code)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def _answer(self, method: str, path: str, raw: bytes, ctype: str
                ) -> tuple[int, dict[str, Any]]:
        if self.fail_all:
            return 503, _status(503, "ServiceUnavailable", "fake API server told to fail")
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError as err:
            return 400, _status(400, "BadRequest", f"body is not JSON: {err}")
        if method == "GET" and (m := _POD.match(path)):
            pod = self.pods.get((m.group(1), m.group(2)))
            if pod is None:
                return 404, _status(404, "NotFound", f'pods "{m.group(2)}" not found')
            return 200, pod
        if method == "POST" and (m := _EVENTS.match(path)):
            if not isinstance(body, dict) or body.get("involvedObject", {}).get(
                    "namespace") != m.group(1):
                return 400, _status(400, "BadRequest", "event namespace does not match")
            self.events.append(body)
            return 201, body
        if (m := _NODE.match(path)) and method in ("GET", "PATCH"):
            node = self.nodes.get(m.group(1))
            if node is None:
                return 404, _status(404, "NotFound", f'nodes "{m.group(1)}" not found')
            if method == "PATCH":
                if "merge-patch" not in ctype or not isinstance(body, dict):
                    return 415, _status(415, "UnsupportedMediaType",
                                        f"fake serves merge patches only, got {ctype}")
                self.patches.append((m.group(1), ctype, body))
                labels = node["metadata"].setdefault("labels", {})
                for key, value in body.get("metadata", {}).get("labels", {}).items():
                    if value is None:
                        labels.pop(key, None)
                    else:
                        labels[key] = value
            return 200, node
        return 404, _status(404, "NotFound", f"the fake API does not serve {method} {path}")


def describe_node(node: dict[str, Any]) -> str:
    """The parts of `kubectl describe node` an operator of gemini.ai/vgpu looks at."""
    meta, status = node["metadata"], node.get("status", {})
    lines = [f"Name:               {meta['name']}"]
    labels = sorted((meta.get("labels") or {}).items())
    for i, (key, value) in enumerate(labels):
        lines.append(f"{'Labels:' if i == 0 else '':<20}{key}={value}")
    if not labels:
        lines.append("Labels:             <none>")
    for title in ("Capacity", "Allocatable"):
        values = status.get(title.lower()) or {}
        lines.append(f"{title}:")
        width = max((len(k) for k in values), default=0) + 1
        lines += [f"  {k + ':':<{width}}  {v}" for k, v in sorted(values.items())]
    return "\n".join(lines)
