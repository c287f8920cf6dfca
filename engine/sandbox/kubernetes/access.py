"""What the runner may do in the sandbox namespace, asked once at start (SPEC §7.1, ADR-0020).

Without this, a Role that was never applied (or a namespace that does not exist) showed up only
at the first sandbox a run asked for, as that run's transient `sandbox_access_denied`, and every
run with a tool node then waited on the nak ladder and parked in the DLQ. A runner that knows at
start it cannot create sandbox pods says so and stops, so the rollout fails where the operator
looks (the pod's log and its restarts), before any run is taken.

The question is a `SelfSubjectAccessReview` per permission the driver uses (the Role in
`deploy/base/sandboxes/role.yaml`): the API server answers for this runner's own credentials,
and every authenticated user may ask it (the built-in `system:basic-user`). An answer that
cannot be had (the API server unreachable, the review itself refused) is not a denial: the
runner starts and says so in its log, and a run's sandbox start will tell.
"""

from __future__ import annotations

import logging

import aiohttp
from kubernetes.aio.client import (
    ApiClient,
    ApiException,
    AuthorizationV1Api,
    V1ResourceAttributes,
    V1SelfSubjectAccessReview,
    V1SelfSubjectAccessReviewSpec,
)

from engine.sandbox.errors import SandboxAccessDenied

__all__ = ["NEEDED", "check_access"]

log = logging.getLogger(__name__)

NEEDED: tuple[tuple[str, str, str], ...] = (
    ("create", "pods", ""),
    ("get", "pods", ""),
    ("list", "pods", ""),
    ("watch", "pods", ""),
    ("delete", "pods", ""),
    ("create", "pods", "exec"),
)
"""(verb, resource, subresource): what the driver does with sandbox pods (create, poll, watch,
delete; exec for commands and the tar copies)."""

_TIMEOUT_S = 10.0


def _shown(verb: str, resource: str, subresource: str) -> str:
    return f"{verb} {resource}/{subresource}" if subresource else f"{verb} {resource}"


async def check_access(client: ApiClient, namespace: str) -> None:
    """Raise `SandboxAccessDenied` naming every permission of `NEEDED` the API server says this
    runner lacks in `namespace`. Returns quietly when all are allowed, and with a warning when
    the question could not be answered."""
    api = AuthorizationV1Api(client)
    denied: list[str] = []
    for verb, resource, subresource in NEEDED:
        review = V1SelfSubjectAccessReview(
            spec=V1SelfSubjectAccessReviewSpec(
                resource_attributes=V1ResourceAttributes(
                    namespace=namespace,
                    verb=verb,
                    resource=resource,
                    subresource=subresource or None,
                )
            )
        )
        try:
            answer = await api.create_self_subject_access_review(
                review, _request_timeout=_TIMEOUT_S
            )
        except (TimeoutError, ApiException, aiohttp.ClientError, OSError) as exc:
            status = getattr(exc, "status", None)
            log.warning(
                "could not check the runner's access to sandbox pods in namespace %r (%s); "
                "starting anyway: a run's sandbox start will say if it is refused",
                namespace,
                f"{status} {getattr(exc, 'reason', '')}".strip() if status else repr(exc),
            )
            return
        status = answer.status
        if status is None:  # not an authorizer's answer (a stand-in API server): no verdict
            log.warning(
                "the API server gave no verdict on sandbox pod access in namespace %r; "
                "starting anyway",
                namespace,
            )
            return
        if not status.allowed:
            why = status.reason or status.evaluation_error or ""
            denied.append(_shown(verb, resource, subresource) + (f" ({why})" if why else ""))
    if denied:
        raise SandboxAccessDenied(
            f"the runner may not {', '.join(denied)} in sandbox namespace {namespace!r} "
            "(asked the API server at start with SelfSubjectAccessReview); no run was taken"
        )
