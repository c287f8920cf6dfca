"""The sandbox pod as SPEC §7.1 builds it: restricted, emptyDir workspace and scratch, named and
labelled per execution, the template merged under the driver's own fields."""

from __future__ import annotations

import re

import pytest
from kubernetes.aio.client import ApiClient, V1Pod

from engine.sandbox.kubernetes.pod import (
    ANNOTATION_RUN_ID,
    ANNOTATION_TOKEN,
    LABEL_EXECUTION,
    LABEL_MANAGED_BY,
    LABEL_RUN_ID,
    PodInvalid,
    build_pod,
    pod_name,
    run_selector,
)

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _pod(**kwargs: object) -> V1Pod:
    args: dict[str, object] = {
        "run_id": "run-1",
        "token": "tok1",
        "namespace": "sandboxes",
        "image": "busybox:1.36",
    }
    args.update(kwargs)
    return build_pod(**args)  # type: ignore[arg-type]


def _manifest(pod: V1Pod) -> dict[str, object]:
    data: dict[str, object] = ApiClient().sanitize_for_serialization(pod)  # type: ignore[no-untyped-call]
    return data


def test_pod_is_restricted_non_root_read_only_no_escalation_all_capabilities_dropped() -> None:
    pod = _pod()
    assert pod.spec is not None and pod.spec.security_context is not None
    assert pod.spec.restart_policy == "Never"
    assert pod.spec.security_context.run_as_non_root is True
    assert pod.spec.security_context.run_as_user not in (None, 0)
    (container,) = pod.spec.containers
    ctx = container.security_context
    assert ctx is not None and ctx.capabilities is not None
    assert ctx.read_only_root_filesystem is True
    assert ctx.allow_privilege_escalation is False
    assert ctx.run_as_non_root is True
    assert ctx.capabilities.drop == ["ALL"]
    assert pod.spec.share_process_namespace is True  # the quiesce sees every process (§7.3)
    assert pod.spec.automount_service_account_token is False
    assert not pod.metadata or not pod.metadata.owner_references


def test_pod_has_emptydir_workspace_and_scratch_mounted_with_the_scratch_env() -> None:
    pod = _pod()
    assert pod.spec is not None
    volumes = {v.name: v for v in pod.spec.volumes or []}
    assert volumes["workspace"].empty_dir is not None
    assert volumes["scratch"].empty_dir is not None
    (container,) = pod.spec.containers
    mounts = {m.name: m.mount_path for m in container.volume_mounts or []}
    assert mounts["workspace"] == "/workspace" and mounts["scratch"] == "/scratch"
    env = {e.name: e.value for e in container.env or []}
    assert env["RUNFLEET_SCRATCH_DIR"] == "/scratch"
    assert container.working_dir == "/workspace"


def test_pod_home_is_the_writable_tmp_unless_the_workflow_sets_it() -> None:
    """The read-only root filesystem leaves a passwd-less user's home (`/`) unwritable."""
    (container,) = _pod().spec.containers  # type: ignore[union-attr]
    env = {e.name: e.value for e in container.env or []}
    assert env["HOME"] == "/tmp"
    assert {m.mount_path for m in container.volume_mounts or []} >= {"/tmp"}
    (container,) = _pod(env={"HOME": "/workspace"}).spec.containers  # type: ignore[union-attr]
    assert {e.name: e.value for e in container.env or []}["HOME"] == "/workspace"


def test_pod_is_named_and_labelled_per_execution() -> None:
    pod = _pod(run_id="Run_With.Odd/Chars:" + "x" * 80, token="T0KEN")
    assert pod.metadata is not None and pod.metadata.labels is not None
    name = pod.metadata.name
    assert name is not None and DNS_LABEL.fullmatch(name), name
    labels = pod.metadata.labels
    assert labels[LABEL_MANAGED_BY] == "runfleet"
    assert labels[LABEL_EXECUTION] == "T0KEN"
    assert len(labels[LABEL_RUN_ID]) <= 63
    assert pod.metadata.annotations is not None
    assert pod.metadata.annotations[ANNOTATION_RUN_ID] == "Run_With.Odd/Chars:" + "x" * 80
    assert pod.metadata.annotations[ANNOTATION_TOKEN] == "T0KEN"
    # another execution of the same run: another pod; the same execution: the same name
    assert pod_name("r", "a") != pod_name("r", "b") and pod_name("r", "a") == pod_name("r", "a")
    assert labels[LABEL_RUN_ID] in run_selector("Run_With.Odd/Chars:" + "x" * 80)


def test_pod_template_is_merged_under_the_drivers_own_fields() -> None:
    template = {
        "metadata": {"labels": {"team": "ml"}, "ownerReferences": [{"kind": "X"}]},
        "spec": {
            "restartPolicy": "Always",
            "nodeSelector": {"pool": "sandboxes"},
            "tolerations": [{"key": "sandbox", "operator": "Exists"}],
            "containers": [
                {
                    "name": "sandbox",
                    "image": "ignored",
                    "securityContext": {"readOnlyRootFilesystem": False, "privileged": True},
                    "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                }
            ],
            "volumes": [{"name": "cache", "emptyDir": {}}],
        },
    }
    pod = _pod(template=template)
    assert pod.spec is not None and pod.metadata is not None and pod.metadata.labels is not None
    assert pod.spec.restart_policy == "Never"
    assert pod.spec.node_selector == {"pool": "sandboxes"}
    assert pod.spec.tolerations and pod.spec.tolerations[0].key == "sandbox"
    assert pod.metadata.labels["team"] == "ml" and pod.metadata.labels[LABEL_MANAGED_BY]
    assert not pod.metadata.owner_references
    (container,) = pod.spec.containers
    assert container.image == "busybox:1.36"
    assert container.security_context is not None
    assert container.security_context.read_only_root_filesystem is True
    mounts = {m.name for m in container.volume_mounts or []}
    assert {"cache", "workspace", "scratch"} <= mounts
    assert {v.name for v in pod.spec.volumes or []} >= {"cache", "workspace", "scratch"}
    assert container.security_context.privileged is False  # the template's True: overruled
    assert pod.spec.host_network is False and pod.spec.host_pid is False
    assert _manifest(pod)["kind"] == "Pod"


def test_pod_template_with_a_misspelled_field_is_refused_by_the_clients_model() -> None:
    with pytest.raises(PodInvalid, match="nodeSelektor"):
        _pod(template={"spec": {"nodeSelektor": {"a": "b"}}})


@pytest.mark.parametrize(
    "template",
    [
        {"spec": {"securityContext": {"runAsUser": 0}}},
        {"spec": {"containers": [{"name": "sandbox", "securityContext": {"runAsUser": 0}}]}},
        {"spec": {"volumes": [{"name": "node", "hostPath": {"path": "/"}}]}},
    ],
)
def test_pod_template_cannot_make_the_sandbox_root_or_reach_its_node(
    template: dict[str, object],
) -> None:
    with pytest.raises(PodInvalid, match=r"root|hostPath"):
        _pod(template=template)


def test_resources_option_reaches_the_container() -> None:
    pod = _pod(resources={"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}})
    assert pod.spec is not None
    (container,) = pod.spec.containers
    assert container.resources is not None
    assert container.resources.requests == {"cpu": "250m"}
    assert container.resources.limits == {"memory": "1Gi"}
