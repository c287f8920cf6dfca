"""The sandbox pod, built as SPEC §7.1 says: a pure function, no I/O.

One pod per execution, named from the run id and the lease token (DNS-1123 safe, with a hash of
both so two executions never share a name), labelled `runfleet.io/run-id`,
`runfleet.io/execution` and `runfleet.io/managed-by` (label-safe values; the exact run id and
token are in annotations, which `list_sandboxes` reads back). The driver's own fields — the
ones Pod Security "restricted" needs, the emptyDir `workspace` and `scratch`, the labels,
`restartPolicy: Never`, `shareProcessNamespace` for the quiesce (§7.3) — are merged *over*
`RUNFLEET_SANDBOX_POD_TEMPLATE`, so a template adds (node selectors, tolerations, volumes, a
sidecar) but never loosens. The merged manifest is validated with the client's own `V1Pod`
model (`model_validate` refuses a misspelled field; `from_dict` would drop it silently).
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Mapping
from typing import Any

from kubernetes.aio.client import V1Pod
from pydantic import ValidationError

__all__ = [
    "ANNOTATION_RUN_ID",
    "ANNOTATION_TOKEN",
    "ATTACHMENTS",
    "CONTAINER",
    "LABEL_EXECUTION",
    "LABEL_MANAGED_BY",
    "LABEL_RUN_ID",
    "MANAGED_BY",
    "SCRATCH",
    "WORKSPACE",
    "PodInvalid",
    "build_pod",
    "label_value",
    "pod_name",
    "run_selector",
]

LABEL_RUN_ID = "runfleet.io/run-id"
LABEL_EXECUTION = "runfleet.io/execution"
LABEL_MANAGED_BY = "runfleet.io/managed-by"
ANNOTATION_RUN_ID = "runfleet.io/run-id"
ANNOTATION_TOKEN = "runfleet.io/lease-token"
MANAGED_BY = "runfleet"
CONTAINER = "sandbox"
WORKSPACE = "/workspace"
SCRATCH = "/scratch"
ATTACHMENTS = "/run/runfleet/attachments"
"""Where a run's attachments are copied in (SPEC §8); an emptyDir, under the read-only root."""
SANDBOX_UID = 65532
"""The user the sandbox runs as unless the template says another (never root)."""

_KEEPALIVE = "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"
"""The container's main process: idle until the pod is deleted, and quick to leave on SIGTERM
(a bare `sleep` as PID 1 ignores it and holds the delete for the whole grace)."""

_LABEL_SAFE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


class PodInvalid(ValueError):
    """The merged manifest is not a valid pod (the template, an option or an image name)."""


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def label_value(value: str) -> str:
    """`value` itself when it is a valid label value, else a readable prefix and a hash."""
    if _LABEL_SAFE.fullmatch(value):
        return value
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:40].strip("-_.")
    return f"{stem}-{_digest(value)[:16]}" if stem else f"h-{_digest(value)[:16]}"


def pod_name(run_id: str, token: str) -> str:
    """`rf-<run id>-<token>-<hash>`, lower-cased and cut to a DNS-1123 label (63 chars)."""

    def clean(text: str, size: int) -> str:
        return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:size].strip("-")

    parts = ["rf", clean(run_id, 30), clean(token, 12), _digest(run_id, token)[:10]]
    return "-".join(p for p in parts if p)


def run_selector(run_id: str | None = None) -> str:
    """The label selector of runfleet's sandbox pods (of one run, when given)."""
    selector = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    if run_id is not None:
        selector += f",{LABEL_RUN_ID}={label_value(run_id)}"
    return selector


def _merge(base: Any, top: Any) -> Any:
    """`top` over `base`: mappings recursively; lists of named items by name (the same
    container, volume or env var is merged, others kept); anything else `top` wins."""
    if isinstance(base, Mapping) and isinstance(top, Mapping):
        out = {k: copy.deepcopy(v) for k, v in base.items()}
        for key, value in top.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(top, list) and _named(base) and _named(top):
        merged = {item["name"]: copy.deepcopy(item) for item in base}
        for item in top:
            name = item["name"]
            merged[name] = _merge(merged[name], item) if name in merged else copy.deepcopy(item)
        return list(merged.values())
    return copy.deepcopy(top)


def _named(items: list[Any]) -> bool:
    return all(isinstance(item, Mapping) and "name" in item for item in items)


def build_pod(
    *,
    run_id: str,
    token: str,
    namespace: str,
    image: str,
    resources: Mapping[str, Mapping[str, str]] | None = None,
    env: Mapping[str, str] | None = None,
    template: Mapping[str, Any] | None = None,
) -> V1Pod:
    """The execution's pod; `PodInvalid` when the merged manifest does not validate."""
    restricted = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    variables = {
        # The sandbox user (any non-root uid) has no passwd entry in most images, so its home
        # would be `/`, read-only here: tools that write `~/.cache` or `~/.gitconfig` failed on
        # the cluster and worked under the local driver. `/tmp` is the pod's writable emptyDir.
        "HOME": "/tmp",
        "RUNFLEET_WORKSPACE": WORKSPACE,
        "RUNFLEET_SCRATCH_DIR": SCRATCH,
        **(env or {}),
    }
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": ["/bin/sh", "-c", _KEEPALIVE],
        "workingDir": WORKSPACE,
        "env": [{"name": k, "value": v} for k, v in variables.items()],
        "securityContext": restricted,
        "volumeMounts": [
            {"name": "workspace", "mountPath": WORKSPACE},
            {"name": "scratch", "mountPath": SCRATCH},
            {"name": "tmp", "mountPath": "/tmp"},
            # The run's attachments, copied in read-only during the seed phase (SPEC §8).
            {"name": "attachments", "mountPath": ATTACHMENTS},
        ],
        # Ready = the workspace is writable by the sandbox's user: commands can start.
        "readinessProbe": {
            "exec": {"command": ["/bin/sh", "-c", f"test -w {WORKSPACE}"]},
            "periodSeconds": 2,
        },
    }
    if resources:
        container["resources"] = {k: dict(v) for k, v in resources.items() if v}
    own: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(run_id, token),
            "namespace": namespace,
            "labels": {
                LABEL_RUN_ID: label_value(run_id),
                LABEL_EXECUTION: label_value(token),
                LABEL_MANAGED_BY: MANAGED_BY,
            },
            "annotations": {ANNOTATION_RUN_ID: run_id, ANNOTATION_TOKEN: token},
        },
        "spec": {
            "restartPolicy": "Never",
            "shareProcessNamespace": True,
            "hostNetwork": False,
            "hostPID": False,
            "hostIPC": False,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [
                {"name": "workspace", "emptyDir": {}},
                {"name": "scratch", "emptyDir": {}},
                {"name": "tmp", "emptyDir": {}},
                {"name": "attachments", "emptyDir": {}},
            ],
        },
    }
    manifest = _merge(dict(template or {}), own)
    manifest["metadata"].pop("ownerReferences", None)  # never across namespaces (§7.1)
    pod_security = manifest["spec"]["securityContext"]
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        pod_security.setdefault(key, SANDBOX_UID)
    if pod_security["runAsUser"] == 0 or any(
        (c.get("securityContext") or {}).get("runAsUser") == 0
        for c in manifest["spec"].get("containers", [])
    ):
        raise PodInvalid("the pod template sets runAsUser 0; a sandbox never runs as root")
    if any("hostPath" in v for v in manifest["spec"].get("volumes", [])):
        raise PodInvalid("the pod template mounts a hostPath; a sandbox never sees its node")
    try:
        return V1Pod.model_validate(manifest)
    except ValidationError as exc:
        raise PodInvalid(f"the sandbox pod does not validate: {exc}") from exc
