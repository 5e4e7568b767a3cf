"""The few Kubernetes API calls the node daemon makes, through the official client.

    GET   /api/v1/namespaces/{ns}/pods/{name}     the pod's uid and annotations
    POST  /api/v1/namespaces/{ns}/events          why an annotation was ignored
    GET   /api/v1/nodes/{node}                    this node's labels
    PATCH /api/v1/nodes/{node}                    gemini.ai/* labels (as GPU feature discovery)
    GET   /api/v1/nodes?watch=true&fieldSelector=metadata.name={node}   (gemini-config-manager)
    POST  /api/v1/namespaces/default/events       an Event on this node
    GET   /apis/apps/v1/namespaces/{ns}/daemonsets/{name}   whether its own DaemonSet is being
                                                  deleted (an uninstall), as the daemon stops
    DELETE /apis/apps/v1/namespaces/{ns}/daemonsets/{name}  propagationPolicy=Foreground: the
                                                  chart's pre-delete hook (gemini-uninstall)

The client is synchronous (urllib3), so every call runs in a worker thread and never stalls the
event loop that serves the channels. `kubernetes` is imported only here, and only when the
daemon is told to use the API: the GPU-side runtime does not need it installed.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vgpu_runtime.contracts.allocation import PodRef

log = logging.getLogger(__name__)

COMPONENT = "gemini-daemon"
REQUEST_TIMEOUT = 5.0


class KubeError(RuntimeError):
    """An API call failed; the message names the call."""


@dataclass(frozen=True)
class NodeInfo:
    uid: str
    labels: dict[str, str]
    resource_version: str


@dataclass(frozen=True)
class PodInfo:
    uid: str
    annotations: dict[str, str]


class KubeApi:
    def __init__(self, api_url: str | None = None, kubeconfig: str | None = None) -> None:
        from kubernetes import client as _client
        from kubernetes import config as _config

        client: Any = _client   # untyped in places; seen as Any
        config: Any = _config
        if kubeconfig:
            configuration = client.Configuration()
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        elif api_url:
            configuration = client.Configuration()
            configuration.host = api_url.rstrip("/")
        else:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
        self._client = client
        self._api: Any = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self._api)
        self.apps = client.AppsV1Api(self._api)

    async def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        def call() -> Any:
            return fn(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        try:
            return await asyncio.to_thread(call)
        except ApiException as err:
            raise KubeError(f"{what}: HTTP {err.status} {err.reason}") from None
        except Exception as err:   # connection refused, timeouts, bad answers
            raise KubeError(f"{what}: {err}") from None

    async def get_pod(self, namespace: str, name: str) -> PodInfo:
        pod = await self._call(f"GET pod {namespace}/{name}", self.core.read_namespaced_pod,
                               name, namespace)
        meta = pod.metadata
        return PodInfo(meta.uid or "", dict(meta.annotations or {}))

    async def pod_owner(self, namespace: str, name: str) -> tuple[str, str] | None:
        """The (kind, name) of the pod's controller (ownerReferences' controller: true)."""
        pod = await self._call(f"GET pod {namespace}/{name}", self.core.read_namespaced_pod,
                               name, namespace)
        for owner in pod.metadata.owner_references or []:
            if owner.controller:
                return str(owner.kind), str(owner.name)
        return None

    async def daemonset_state(self, namespace: str, name: str) -> str:
        """"standing", "deleting" (marked for deletion: a foreground delete keeps it until its
        pods are gone) or "gone" (404)."""
        from kubernetes.client.exceptions import ApiException

        def call() -> Any:
            return self.apps.read_namespaced_daemon_set(name, namespace,
                                                        _request_timeout=REQUEST_TIMEOUT)
        try:
            found = await asyncio.to_thread(call)
        except ApiException as err:
            if err.status == 404:
                return "gone"
            raise KubeError(f"GET daemonset {namespace}/{name}: HTTP {err.status} "
                            f"{err.reason}") from None
        except Exception as err:   # connection refused, timeouts, bad answers
            raise KubeError(f"GET daemonset {namespace}/{name}: {err}") from None
        return "standing" if found.metadata.deletion_timestamp is None else "deleting"

    async def delete_daemonset(self, namespace: str, name: str) -> bool:
        """Delete in the foreground: the DaemonSet stays, marked, until its pods are gone.
        False if there was none."""
        c = self._client
        from kubernetes.client.exceptions import ApiException

        def call() -> Any:
            return self.apps.delete_namespaced_daemon_set(
                name, namespace, body=c.V1DeleteOptions(propagation_policy="Foreground"),
                _request_timeout=REQUEST_TIMEOUT)
        try:
            await asyncio.to_thread(call)
        except ApiException as err:
            if err.status == 404:
                return False
            raise KubeError(f"DELETE daemonset {namespace}/{name}: HTTP {err.status} "
                            f"{err.reason}") from None
        except Exception as err:
            raise KubeError(f"DELETE daemonset {namespace}/{name}: {err}") from None
        return True

    async def post_event(self, pod: PodRef, node: str, reason: str, message: str,
                         kind: str = "Warning") -> None:
        c = self._client
        now = datetime.datetime.now(datetime.timezone.utc)
        event = c.CoreV1Event(
            metadata=c.V1ObjectMeta(name=f"{pod.name}.{secrets.token_hex(8)}",
                                    namespace=pod.namespace),
            involved_object=c.V1ObjectReference(kind="Pod", api_version="v1",
                                                namespace=pod.namespace, name=pod.name,
                                                uid=pod.uid or None),
            reason=reason, message=message, type=kind, count=1,
            first_timestamp=now, last_timestamp=now,
            source=c.V1EventSource(component=COMPONENT, host=node),
            reporting_component=COMPONENT, reporting_instance=node)
        await self._call(f"POST event on pod {pod.namespace}/{pod.name}",
                         self.core.create_namespaced_event, pod.namespace, event)

    async def post_node_event(self, node: str, reason: str, message: str,
                              component: str = COMPONENT, kind: str = "Warning") -> None:
        """An Event on a Node as kubelet posts its own: in the default namespace, the node's
        name standing for its uid. Every `kubectl describe node` finds those (older releases
        look only by the name as uid; newer ones by the uid and by the name)."""
        c = self._client
        now = datetime.datetime.now(datetime.timezone.utc)
        event = c.CoreV1Event(
            metadata=c.V1ObjectMeta(name=f"{node}.{secrets.token_hex(8)}", namespace="default"),
            involved_object=c.V1ObjectReference(kind="Node", api_version="v1", name=node,
                                                uid=node),
            reason=reason, message=message, type=kind, count=1,
            first_timestamp=now, last_timestamp=now,
            source=c.V1EventSource(component=component, host=node),
            reporting_component=component, reporting_instance=node)
        await self._call(f"POST event on node {node}", self.core.create_namespaced_event,
                         "default", event)

    async def node(self, node: str) -> NodeInfo:
        found = await self._call(f"GET node {node}", self.core.read_node, node)
        meta = found.metadata
        return NodeInfo(meta.uid or "", dict(meta.labels or {}), meta.resource_version or "")

    def watch_node(self, node: str, resource_version: str, timeout: float
                   ) -> Iterator[tuple[str, NodeInfo]]:
        """Blocking: (event type, the node) for each change after `resource_version`, until
        the API server ends the watch (about `timeout` seconds). Raises KubeError."""
        from kubernetes import watch as _watch
        from kubernetes.client.exceptions import ApiException

        watch: Any = _watch   # untyped
        try:
            for event in watch.Watch().stream(
                    self.core.list_node, field_selector=f"metadata.name={node}",
                    resource_version=resource_version, timeout_seconds=int(timeout),
                    _request_timeout=timeout + REQUEST_TIMEOUT):
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    raise KubeError(f"watch node {node}: {event.get('raw_object')}")
                meta = obj.metadata
                yield kind, NodeInfo(meta.uid or "", dict(meta.labels or {}),
                                     meta.resource_version or "")
        except ApiException as err:
            raise KubeError(f"watch node {node}: HTTP {err.status} {err.reason}") from None
        except KubeError:
            raise
        except Exception as err:   # connection refused, reset, timeouts, bad answers
            raise KubeError(f"watch node {node}: {err}") from None

    async def node_labels(self, node: str) -> dict[str, str]:
        found = await self._call(f"GET node {node}", self.core.read_node, node)
        return dict(found.metadata.labels or {})

    async def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """A merge patch of metadata.labels (None removes a label)."""
        await self._call(f"PATCH node {node}", self.core.patch_node, node,
                         {"metadata": {"labels": dict(labels)}})

    def close(self) -> None:
        self._api.close()
