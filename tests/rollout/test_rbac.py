"""The ClusterRole is no broader than the API calls the code makes (issue 29): the grants are
derived here from vgpu_runtime/daemon/pods/kube.py's calls on the client's CoreV1Api, and every
call is listed beside the Role in daemonset/base/rbac.yaml and the chart's template.
tests/cluster/test_node.py asks the real API server what the ServiceAccount may do."""

from __future__ import annotations

import ast
import re

from tests.childenv import REPO
from tests.rollout import manifests as m

KUBE = REPO / "vgpu_runtime" / "daemon" / "pods" / "kube.py"
BASE_RBAC = m.BASE / "rbac.yaml"
CHART_RBAC = m.DAEMONSET / "chart" / "gemini-vgpu" / "templates" / "rbac.yaml"
# CoreV1Api's method names: <action>_[namespaced_]<kind>; the action's RBAC verb.
ACTIONS = {"read": "get", "create": "create", "patch": "patch", "list": "list",
           "delete": "delete", "replace": "update", "connect": "create"}
CORE_METHOD = re.compile(r"^(read|create|patch|list|delete|replace|connect)_"
                         r"(?:namespaced_)?([a-z_]+?)(?:_status)?$")

Grant = tuple[str, str, str]   # (apiGroup, resource, verb)


def core_calls(source: str | None = None) -> dict[str, set[Grant]]:
    """KubeApi's methods (in kube.py, or `source`) -> the grants their CoreV1Api calls need. A
    list method handed to Watch().stream is a watch (GET ?watch=true), and needs watch, not
    list."""
    tree = ast.parse(KUBE.read_text() if source is None else source)
    (api,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KubeApi"]
    calls: dict[str, set[Grant]] = {}
    for method in (n for n in api.body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        streamed = {id(call.args[0]) for call in ast.walk(method)
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "stream" and call.args}
        for node in ast.walk(method):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "core"):
                continue
            match = CORE_METHOD.match(node.attr)
            assert match, f"KubeApi.{method.name}: no rule for CoreV1Api.{node.attr}"
            action, kind = match.groups()
            verb = "watch" if action == "list" and id(node) in streamed else ACTIONS[action]
            calls.setdefault(method.name, set()).add(("", kind + "s", verb))
    return calls


def role_grants() -> set[Grant]:
    role = m.find(m.load_objects(BASE_RBAC), "ClusterRole", "gemini-vgpu-node")
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def test_the_role_grants_exactly_what_the_codes_calls_need() -> None:
    calls = core_calls()
    # Not vacuous: the pod read, both Events, the node's labels and the config manager's watch.
    assert {"get_pod", "post_event", "post_node_event", "patch_node_labels",
            "watch_node"} <= set(calls), calls
    needed = set().union(*calls.values())
    assert role_grants() == needed, (role_grants() - needed, needed - role_grants())


def test_every_call_is_listed_beside_the_role() -> None:
    for path in (BASE_RBAC, CHART_RBAC):
        comments = "\n".join(line for line in path.read_text().splitlines()
                             if line.lstrip().startswith("#"))
        missing = [name for name in core_calls() if f"KubeApi.{name}" not in comments]
        assert not missing, f"{path.relative_to(REPO)} does not list {missing}"


def test_only_kube_py_talks_to_the_api_server() -> None:
    """The Kubernetes client is imported in kube.py alone (devkit's fake API server imports its
    models to answer, not to call)."""
    importers = sorted(
        str(path.relative_to(REPO)) for root in ("vgpu_runtime", "device_plugin")
        for path in (REPO / root).rglob("*.py")
        if re.search(r"^\s*(from kubernetes\b|import kubernetes\b)", path.read_text(), re.M)
        and "devkit" not in path.parts)
    assert importers == [str(KUBE.relative_to(REPO))]
    # And nothing builds API paths by hand beside it.
    by_hand = sorted(str(path.relative_to(REPO)) for root in ("vgpu_runtime", "device_plugin")
                     for path in (REPO / root).rglob("*.py")
                     if '"/api/' in path.read_text() and "devkit" not in path.parts)
    assert by_hand == []


def test_grants_are_derived_not_assumed() -> None:
    """A new call shows up as a new grant the Role lacks: a pod list (not streamed) needs pods
    list, a streamed one pods watch."""
    method = ("\n    async def {name}(self, namespace: str) -> None:\n"
              "        {body}\n")
    listed = KUBE.read_text() + method.format(
        name="pods_here", body="await self._call('LIST', self.core.list_namespaced_pod, "
        "namespace)")
    assert core_calls(listed)["pods_here"] == {("", "pods", "list")}
    watched = KUBE.read_text() + method.format(
        name="watch_pods", body="Watch().stream(self.core.list_namespaced_pod, namespace)")
    assert core_calls(watched)["watch_pods"] == {("", "pods", "watch")}
    assert ("", "pods", "list") not in role_grants()
