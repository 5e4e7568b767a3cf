"""The RBAC is no broader than the API calls the code makes: the grants are derived
here from vgpu_runtime/daemon/pods/kube.py's calls on the client's CoreV1Api and AppsV1Api, each
call given to the programs that make it, and every call is listed beside the roles in
daemonset/base/rbac.yaml and the chart's templates.

Two ServiceAccounts: gemini-vgpu (the node daemon and the config manager: the ClusterRole and
the Role of daemonset/base/rbac.yaml) and gemini-vgpu-uninstall (gemini-uninstall, the chart's
pre-delete hook; tests/cluster/test_chart.py holds its rendered Role to these calls).
tests/cluster/test_node.py asks the real API server what the node ServiceAccount may do."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.childenv import REPO
from tests.rollout import manifests as m

KUBE = REPO / "vgpu_runtime" / "daemon" / "pods" / "kube.py"
BASE_RBAC = m.BASE / "rbac.yaml"
CHART = m.DAEMONSET / "chart" / "gemini-vgpu" / "templates"
# Who calls KubeApi, under which ServiceAccount.
NODE_CALLERS = [*sorted((REPO / "vgpu_runtime" / "daemon").rglob("*.py")),
                REPO / "vgpu_runtime" / "configmanager.py"]
HOOK_CALLERS = [REPO / "vgpu_runtime" / "uninstall.py"]
# The client's method names: <action>_[namespaced_]<kind>; the action's RBAC verb.
ACTIONS = {"read": "get", "create": "create", "patch": "patch", "list": "list",
           "delete": "delete", "replace": "update", "connect": "create"}
CLIENT_METHOD = re.compile(r"^(read|create|patch|list|delete|replace|connect)_"
                           r"(?:namespaced_)?([a-z_]+?)(?:_status)?$")
GROUPS = {"core": "", "apps": "apps"}   # KubeApi's attribute -> the API group

Grant = tuple[str, str, str]   # (apiGroup, resource, verb)


def api_calls(source: str | None = None) -> dict[str, set[Grant]]:
    """KubeApi's methods (in kube.py, or `source`) -> the grants their client calls need. A
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
                    and node.value.attr in GROUPS):
                continue
            match = CLIENT_METHOD.match(node.attr)
            assert match, f"KubeApi.{method.name}: no rule for {node.value.attr}.{node.attr}"
            action, kind = match.groups()
            verb = "watch" if action == "list" and id(node) in streamed else ACTIONS[action]
            calls.setdefault(method.name, set()).add(
                (GROUPS[node.value.attr], kind.replace("_", "") + "s", verb))
    return calls


def called(files: list[Path], methods: set[str]) -> set[str]:
    """Which of KubeApi's `methods` the files call on a `kube` (self.kube.x, kube.x)."""
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in methods
                    and ((isinstance(node.value, ast.Attribute) and node.value.attr == "kube")
                         or (isinstance(node.value, ast.Name) and node.value.id == "kube"))):
                found.add(node.attr)
    return found


def needed(files: list[Path]) -> set[Grant]:
    calls = api_calls()
    return set().union(*(calls[name] for name in called(files, set(calls))))


def grants(*roles: m.Obj) -> set[Grant]:
    return {(group, resource, verb) for role in roles for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def node_roles() -> list[m.Obj]:
    objects = m.load_objects(BASE_RBAC)
    return [m.find(objects, "ClusterRole", "gemini-vgpu-node"),
            m.find(objects, "Role", "gemini-vgpu-node")]


def test_the_node_roles_grant_exactly_what_the_daemons_calls_need() -> None:
    calls = api_calls()
    # Not vacuous: the pod read, both Events, the node's labels, the config manager's watch,
    # the DaemonSet read at a stop.
    assert {"get_pod", "post_event", "post_node_event", "patch_node_labels", "watch_node",
            "daemonset_state"} <= called(NODE_CALLERS, set(calls)), calls
    want = needed(NODE_CALLERS)
    have = grants(*node_roles())
    assert have == want, (have - want, want - have)


def test_events_are_granted_cluster_wide() -> None:
    """A Node's Events go to namespace default (as kubelet's: a process of no allocation, slices
    per GPU, the configuration) and a pod's to the pod's namespace; a Role in the daemon's own
    namespace would let neither through, so the grant is the ClusterRole's."""
    cluster, namespaced = node_roles()
    assert ("", "events", "create") in grants(cluster)
    assert ("", "events", "create") not in grants(namespaced)
    source = KUBE.read_text()
    assert re.search(r'create_namespaced_event,\s*"default"', source), "node Events' namespace"


def test_the_namespaced_role_is_the_one_daemonset_by_name() -> None:
    (rule,) = m.find(m.load_objects(BASE_RBAC), "Role", "gemini-vgpu-node")["rules"]
    assert rule["resourceNames"] == ["gemini-vgpu-node"]
    (daemonset,) = [o for o in m.load_objects(m.BASE / "node" / "daemonset.yaml")
                    if o["kind"] == "DaemonSet"]
    assert daemonset["metadata"]["name"] == "gemini-vgpu-node"


def test_every_call_is_called_and_listed_beside_the_roles() -> None:
    calls = set(api_calls())
    assert called(NODE_CALLERS + HOOK_CALLERS, calls) == calls, "a KubeApi call nobody makes"
    node = called(NODE_CALLERS, calls)
    hook = called(HOOK_CALLERS, calls)
    for path, names in ((BASE_RBAC, node), (CHART / "rbac.yaml", node),
                        (CHART / "uninstall.yaml", hook)):
        comments = "\n".join(line for line in path.read_text().splitlines()
                             if line.lstrip().startswith("#"))
        missing = sorted(name for name in names if f"KubeApi.{name}" not in comments)
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
                     if '"/api' in path.read_text() and "devkit" not in path.parts)
    assert by_hand == []


def test_grants_are_derived_not_assumed() -> None:
    """A new call shows up as a new grant the roles lack: a pod list (not streamed) needs pods
    list, a streamed one pods watch, a DaemonSet patch apps daemonsets patch."""
    method = ("\n    async def {name}(self, namespace: str) -> None:\n"
              "        {body}\n")
    source = KUBE.read_text() + "".join(method.format(name=name, body=body) for name, body in (
        ("pods_here", "await self._call('LIST', self.core.list_namespaced_pod, namespace)"),
        ("watch_pods", "Watch().stream(self.core.list_namespaced_pod, namespace)"),
        ("patch_ds", "self.apps.patch_namespaced_daemon_set('x', namespace, {})")))
    calls = api_calls(source)
    assert calls["pods_here"] == {("", "pods", "list")}
    assert calls["watch_pods"] == {("", "pods", "watch")}
    assert calls["patch_ds"] == {("apps", "daemonsets", "patch")}
    assert not {("", "pods", "list"), ("apps", "daemonsets", "patch")} & grants(*node_roles())
