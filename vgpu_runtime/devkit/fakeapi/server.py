"""A fake Kubernetes API server (HTTP, in a thread) serving only what gemini-daemon calls:

    GET   /api/v1/namespaces/{ns}/pods/{name}
    POST  /api/v1/namespaces/{ns}/events
    GET   /api/v1/nodes/{name}
    PATCH /api/v1/nodes/{name}        merge or strategic-merge patch of metadata.labels
    GET   /api/v1/nodes?watch=true&fieldSelector=metadata.name={name}&resourceVersion=N
                                      MODIFIED events, chunked, until timeoutSeconds
    GET    /apis/apps/v1/namespaces/{ns}/daemonsets/{name}
    DELETE /apis/apps/v1/namespaces/{ns}/daemonsets/{name}   Foreground marks it for deletion
                                      (deletionTimestamp) until the test ends it
                                      (`finish_deletion`, the garbage collector's part); any
                                      other propagation removes it at once

Objects are built with the official client's models and serialized by its ApiClient, so the
daemon's client parses exactly what a real API server would send. Every request is recorded
(`requests`, `events`, `patches`) for the tests to assert on. Anything else is a 404 Status.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client as k8s

_api: Any = k8s.ApiClient()
_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
_NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")
_NODES = "/api/v1/nodes"
_DAEMONSET = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/daemonsets/([^/]+)$")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeApiServer:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.daemonsets: dict[tuple[str, str], dict[str, Any]] = {}
        self.deletes: list[tuple[str, str, dict[str, Any] | None]] = []   # ns, name, options
        self.events: list[dict[str, Any]] = []
        self.patches: list[tuple[str, str, dict[str, Any]]] = []   # node, content type, body
        self.requests: list[tuple[str, str]] = []
        self.watches = 0          # node watches opened
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)   # notified on every node change
        self._version = 0
        self.fail_all = False    # answer 503 to everything (API server away)
        self.fail_posts = False  # answer 503 to every POST (Events refused)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

            def do_PATCH(self) -> None:
                fake._handle(self, "PATCH")

            def do_DELETE(self) -> None:
                fake._handle(self, "DELETE")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        # HTTP/1.1 for the chunked watch stream; every other answer has a Content-Length.
        Handler.protocol_version = "HTTP/1.1"

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self._closing = True
            self.changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    _closing = False

    def _bump(self, node: dict[str, Any]) -> None:
        """Called with the lock held after a change of `node`."""
        self._version += 1
        node["metadata"]["resourceVersion"] = str(self._version)
        self.changed.notify_all()

    # ---- objects ----

    def add_pod(self, namespace: str, name: str, uid: str,
                annotations: dict[str, str] | None = None,
                daemonset: str | None = None) -> None:
        """A pod; `daemonset` names its controller (ownerReferences, controller: true)."""
        owners = None if daemonset is None else [k8s.V1OwnerReference(
            api_version="apps/v1", kind="DaemonSet", name=daemonset, uid=f"uid-{daemonset}",
            controller=True, block_owner_deletion=True)]
        pod = k8s.V1Pod(api_version="v1", kind="Pod", metadata=k8s.V1ObjectMeta(
            name=name, namespace=namespace, uid=uid, annotations=annotations or {},
            owner_references=owners))
        with self.lock:
            self.pods[(namespace, name)] = _api.sanitize_for_serialization(pod)

    def add_daemonset(self, namespace: str, name: str) -> None:
        labels = {"app.kubernetes.io/name": name}
        daemonset = k8s.V1DaemonSet(
            api_version="apps/v1", kind="DaemonSet",
            metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, uid=f"uid-{name}"),
            spec=k8s.V1DaemonSetSpec(
                selector=k8s.V1LabelSelector(match_labels=labels),
                template=k8s.V1PodTemplateSpec(
                    metadata=k8s.V1ObjectMeta(labels=labels),
                    spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="node")]))))
        with self.lock:
            self.daemonsets[(namespace, name)] = _api.sanitize_for_serialization(daemonset)

    def finish_deletion(self, namespace: str, name: str) -> None:
        """The garbage collector's part of a foreground delete: its pods gone, it goes."""
        with self.lock:
            self.daemonsets.pop((namespace, name), None)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        node = k8s.V1Node(api_version="v1", kind="Node",
                          metadata=k8s.V1ObjectMeta(name=name, uid=f"uid-{name}",
                                                    labels=labels or {}),
                          status=k8s.V1NodeStatus(capacity={}, allocatable={}))
        with self.lock:
            self.nodes[name] = _api.sanitize_for_serialization(node)
            self._bump(self.nodes[name])

    def set_node_labels(self, name: str, labels: dict[str, str | None]) -> None:
        """What `kubectl label node` does: None removes a label."""
        with self.lock:
            node = self.nodes[name]
            current = node["metadata"].setdefault("labels", {})
            for key, value in labels.items():
                if value is None:
                    current.pop(key, None)
                else:
                    current[key] = value
            self._bump(node)

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
            # A Node's Events have no involvedObject namespace.
            return [e for e in self.events if e["involvedObject"].get("namespace") == namespace
                    and e["involvedObject"]["name"] == name]

    def node_events(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e["involvedObject"].get("kind") == "Node"
                    and e["involvedObject"]["name"] == name]

    # ---- HTTP ----

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        path, _, query = request.path.partition("?")
        params = dict(urllib.parse.parse_qsl(query))
        if method == "GET" and path == _NODES and params.get("watch") in ("true", "1"):
            with self.lock:
                self.requests.append(("WATCH", path))
            self._watch_nodes(request, params)
            return
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
        if self.fail_all or (self.fail_posts and method == "POST"):
            return 503, _status(503, "ServiceUnavailable", "fake API server told to fail")
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError as err:
            return 400, _status(400, "BadRequest", f"body is not JSON: {err}")
        if (m := _DAEMONSET.match(path)) and method in ("GET", "DELETE"):
            key = (m.group(1), m.group(2))
            daemonset = self.daemonsets.get(key)
            if daemonset is None:
                return 404, _status(404, "NotFound",
                                    f'daemonsets.apps "{m.group(2)}" not found')
            if method == "DELETE":
                self.deletes.append((*key, body))
                policy = (body or {}).get("propagationPolicy")
                if policy == "Foreground":
                    daemonset["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
                    daemonset["metadata"]["finalizers"] = ["foregroundDeletion"]
                else:
                    del self.daemonsets[key]
            return 200, daemonset
        if method == "GET" and (m := _POD.match(path)):
            pod = self.pods.get((m.group(1), m.group(2)))
            if pod is None:
                return 404, _status(404, "NotFound", f'pods "{m.group(2)}" not found')
            return 200, pod
        if method == "POST" and (m := _EVENTS.match(path)):
            # As the API server validates: a namespaced object's Event is in its namespace; a
            # cluster object's (a Node's) has no involvedObject namespace and lives in default.
            involved = body.get("involvedObject", {}) if isinstance(body, dict) else {}
            expected = "" if m.group(1) == "default" and involved.get("kind") == "Node" else (
                m.group(1))
            if not isinstance(body, dict) or (involved.get("namespace") or "") != expected:
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
                self._bump(node)
            return 200, node
        return 404, _status(404, "NotFound", f"the fake API does not serve {method} {path}")


    def _watch_nodes(self, request: BaseHTTPRequestHandler, params: dict[str, str]) -> None:
        """A watch of one node (fieldSelector metadata.name=X, as the only selector served):
        each change after resourceVersion as a MODIFIED event, until timeoutSeconds."""
        selector = params.get("fieldSelector", "")
        name = selector.removeprefix("metadata.name=")
        since = int(params.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(params.get("timeoutSeconds") or 300)
        with self.lock:
            self.watches += 1
            refuse = self.fail_all or not selector.startswith("metadata.name=")
        if refuse:
            body = json.dumps(_status(503, "ServiceUnavailable", "no watch")).encode()
            request.send_response(503)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
            return
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()

        def chunk(data: bytes) -> None:
            request.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            request.wfile.flush()

        try:
            while True:
                with self.lock:
                    while True:
                        node = self.nodes.get(name)
                        version = int(node["metadata"]["resourceVersion"]) if node else 0
                        left = deadline - time.monotonic()
                        if version > since or left <= 0 or self._closing or self.fail_all:
                            break
                        self.changed.wait(left)
                    if version <= since or self._closing or self.fail_all:
                        break
                    event = {"type": "MODIFIED", "object": json.loads(json.dumps(node))}
                since = version
                chunk(json.dumps(event).encode() + b"\n")
            request.wfile.write(b"0\r\n\r\n")
            request.wfile.flush()
        except OSError:
            pass   # the client went away
        request.close_connection = True


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
