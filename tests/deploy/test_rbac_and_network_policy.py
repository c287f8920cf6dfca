"""What the runners may do and reach (SPEC §11): RBAC on sandbox pods in one namespace only,
bound to the runners' ServiceAccount, and a NetworkPolicy that admits the metrics port only and
lets out DNS, NATS (in its namespace), MongoDB, HTTPS and the API server."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest

from publisher.config import WireSettings
from tests.deploy.manifests import (
    METRICS_PORT_NAME,
    OVERLAYS,
    Manifest,
    find,
    one,
    pod_spec,
    runner_deployment,
    runner_env,
    streams_job,
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_is_limited_to_sandbox_pods_in_one_namespace(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    manifests = rendered[overlay]
    assert not find(manifests, "ClusterRole") and not find(manifests, "ClusterRoleBinding")
    role = one(manifests, "Role")
    binding = one(manifests, "RoleBinding")
    sandbox_ns = runner_env(manifests)["RUNFLEET_SANDBOX_NAMESPACE"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == sandbox_ns
    assert one(manifests, "Namespace", sandbox_ns)
    allowed = {
        "pods": {"create", "get", "list", "watch", "delete"},
        "pods/exec": {"create", "get"},
    }  # exactly what engine/sandbox/kubernetes/ calls (docs/kubernetes.md "RBAC")
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""]
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs")
        for resource in rule["resources"]:
            assert resource in allowed, f"the runner may not touch {resource}"
            assert set(rule["verbs"]) <= allowed[resource], (resource, rule["verbs"])
    granted = {r for rule in role["rules"] for r in rule["resources"]}
    assert granted == set(allowed)
    # Bound to the runners' ServiceAccount only; the runners live elsewhere, so exec rights
    # never reach a runner pod (or the Secrets in its environment).
    deployment = runner_deployment(manifests)
    account = one(manifests, "ServiceAccount", pod_spec(deployment)["serviceAccountName"])
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": deployment["metadata"]["namespace"],
        }
    ]
    assert deployment["metadata"]["namespace"] != sandbox_ns
    assert pod_spec(streams_job(manifests))["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_admits_only_the_metrics_port_and_the_listed_egress(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    manifests = rendered[overlay]
    policy = one(manifests, "NetworkPolicy", "runfleet-runner")
    labels = runner_deployment(manifests)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ingress_ports = [p for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert ingress_ports == [{"port": METRICS_PORT_NAME, "protocol": "TCP"}]
    egress = {
        (p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"]
    }
    settings_env(runner_env(manifests))
    nats_port = int(WireSettings().effective_nats_url().rsplit(":", 1)[1])
    assert egress == {
        (53, "UDP"),
        (53, "TCP"),
        (nats_port, "TCP"),
        (27017, "TCP"),
        (443, "TCP"),
        (6443, "TCP"),
    }
    nats_rule = next(
        r
        for r in policy["spec"]["egress"]
        if r["ports"] == [{"port": nats_port, "protocol": "TCP"}]
    )
    nats_ns = WireSettings().effective_nats_url().split("://")[1].split(".")[1]
    selector = nats_rule["to"][0]["namespaceSelector"]["matchLabels"]
    assert selector == {"kubernetes.io/metadata.name": nats_ns}
    sandbox_policy = one(manifests, "NetworkPolicy", "runfleet-sandboxes-deny-ingress")
    assert sandbox_policy["spec"]["podSelector"] == {}
    assert "ingress" not in sandbox_policy["spec"]  # nothing connects to a sandbox


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sandboxes_reach_dns_and_the_internet_but_nothing_private(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    """A sandbox runs arbitrary workflow code: it must not reach NATS, the store, the runners,
    the API server or the cloud metadata address (the node's credentials)."""
    policy = one(rendered[overlay], "NetworkPolicy", "runfleet-sandboxes-deny-ingress")["spec"]
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    blocks = [
        to["ipBlock"] for rule in policy["egress"] for to in rule.get("to", []) if "ipBlock" in to
    ]
    (block,) = blocks
    denied = [ipaddress.ip_network(c) for c in block["except"]]

    def reachable(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(ip in n for n in denied)

    assert reachable("140.82.112.3") and reachable("151.101.0.223")  # public hosts
    for private in ("169.254.169.254", "10.96.0.1", "172.20.0.10", "192.168.1.5", "100.64.0.1"):
        assert not reachable(private), private
    for rule in policy["egress"]:  # every other rule is DNS only
        if not any("ipBlock" in to for to in rule.get("to", [])):
            assert {p["port"] for p in rule["ports"]} == {53}
