"""`KubernetesSandboxDriver`: one pod per execution behind the `SandboxDriver` protocol (SPEC §7.1).

`start` runs the setup phases, each on its own budget: create the pod (`pod.py`), poll it
through *schedule* (created → scheduled, containers started) and *ready* (started → Ready),
each poll judged by `classify.classify_start`, then *seed* (`spec.seed_dirs` copied in over
exec). Any failure deletes the pod before it raises: nothing is left running. A Ready pod gets
its continuity watch (`watch.PodWatch`, §7.2) until `stop`; the sandbox's `exec` races the
command against the watch, so a lost pod fails the node at once and the exec in flight is
abandoned. `stop_others` and `list_sandboxes` select by label and filter again client-side (a
label is a hash when a run id is not label-safe; the annotations carry the exact values), and
every delete carries the UID that was listed as a precondition: a pod recreated under the name
between the list and the delete is never the one deleted.

The pods are read by polling during start (the watch is for a running sandbox); the driver
never lists events (its RBAC stays pods and pods/exec: docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable

import aiohttp
from kubernetes.aio import config as kube_config
from kubernetes.aio.client import (
    ApiClient,
    ApiException,
    Configuration,
    CoreV1Api,
    V1DeleteOptions,
    V1Pod,
    V1Preconditions,
)

from engine.failures import FailureCode
from engine.sandbox.errors import (
    SandboxAccessDenied,
    SandboxCapacity,
    SandboxError,
    SandboxImageInvalid,
    SandboxLost,
    SandboxSetupTimeout,
    SandboxStartFailed,
)
from engine.sandbox.kubernetes.access import check_access
from engine.sandbox.kubernetes.classify import (
    Phase,
    StartFailure,
    classify_create_error,
    classify_start,
    refused_access,
)
from engine.sandbox.kubernetes.copy import copy_in
from engine.sandbox.kubernetes.pod import (
    ANNOTATION_RUN_ID,
    ANNOTATION_TOKEN,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    PodInvalid,
    build_pod,
    run_selector,
)
from engine.sandbox.kubernetes.sandbox import KubernetesSandbox, pack_dir, sandbox_path
from engine.sandbox.kubernetes.settings import KubernetesSettings
from engine.sandbox.kubernetes.watch import PodWatch
from engine.sandbox.protocols import SandboxCapabilities, SandboxRef, SandboxSpec, SetupBudgets

__all__ = ["ApiFactory", "KubernetesSandboxDriver"]

log = logging.getLogger(__name__)

_CAPABILITIES = SandboxCapabilities(
    process_isolated=True, host_backed_scratch=False, supports_dir_copy=True, attachments="copy"
)
_ERRORS: dict[FailureCode, type[SandboxError]] = {
    FailureCode.SANDBOX_CAPACITY: SandboxCapacity,
    FailureCode.SANDBOX_IMAGE_INVALID: SandboxImageInvalid,
    FailureCode.SANDBOX_START_FAILED: SandboxStartFailed,
    FailureCode.SANDBOX_SETUP_TIMEOUT: SandboxSetupTimeout,
    FailureCode.SANDBOX_LOST: SandboxLost,
}
_UNREACHABLE = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
"""What a request that never got the API server's answer raises."""
_REQUEST_TIMEOUT_S = 15.0

ApiFactory = Callable[[], Awaitable[ApiClient]]


async def default_api_client() -> ApiClient:
    """In a pod: the ServiceAccount's in-cluster config; elsewhere `KUBECONFIG` (or
    `~/.kube/config`)."""
    configuration = Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        # `KUBECONFIG` read now: the client's default location was fixed when it was imported.
        await kube_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    return ApiClient(configuration)


def _error(failure: StartFailure) -> SandboxError:
    return _ERRORS[failure.code](failure.message)


class KubernetesSandboxDriver:
    """Sandbox pods in `settings.namespace`, through one API client opened on first use."""

    def __init__(
        self,
        settings: KubernetesSettings,
        *,
        api_factory: ApiFactory = default_api_client,
        poll_s: float = 1.0,
    ) -> None:
        self.settings = settings
        self._api_factory = api_factory
        self._poll_s = poll_s
        self._client: ApiClient | None = None
        self._lock = asyncio.Lock()

    @property
    def capabilities(self) -> SandboxCapabilities:
        return _CAPABILITIES

    async def api(self) -> CoreV1Api:
        async with self._lock:
            if self._client is None:
                try:
                    self._client = await self._api_factory()
                except kube_config.ConfigException as exc:
                    raise SandboxError(f"no kubernetes API: {exc}") from exc
        return CoreV1Api(self._client)

    async def preflight(self) -> None:
        """At the runner's start: `SandboxAccessDenied` when this runner may not manage sandbox
        pods in its namespace (`access.check_access`); a warning when that cannot be asked."""
        try:
            await self.api()
        except SandboxError as exc:  # no kubeconfig: the first start says it, as before
            log.warning("sandbox driver: %s", exc)
            return
        assert self._client is not None
        await check_access(self._client, self.settings.namespace)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()  # type: ignore[no-untyped-call]
            self._client = None

    # -- start ---------------------------------------------------------------------------------

    async def start(self, spec: SandboxSpec) -> KubernetesSandbox:
        budgets = spec.budgets or self.settings.budgets
        namespace = self.settings.namespace
        image = spec.image or self.settings.image
        if not image:
            raise SandboxStartFailed(
                "sandbox pod: create phase: no image (set RUNFLEET_SANDBOX_IMAGE or the "
                "workflow's sandbox.options.image)"
            )
        try:
            manifest = build_pod(
                run_id=spec.run_id,
                token=spec.lease_token,
                namespace=namespace,
                image=image,
                resources=spec.resources,
                env=spec.env,
                template=self.settings.pod_template,
            )
        except PodInvalid as exc:
            raise SandboxStartFailed(f"sandbox pod: create phase: {exc}") from exc
        assert manifest.metadata is not None and manifest.metadata.name is not None
        name = manifest.metadata.name
        api = await self.api()
        uid = await self._create(api, manifest, budgets.schedule_s)
        try:
            pod = await self._until_ready(api, name, uid, budgets)
            uid = uid or (pod.metadata.uid if pod.metadata else None) or ""
            await self._seed(api, spec, name, pod, uid)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.delete_pod(api, name, uid or None)
            raise
        watch = PodWatch(api, namespace, name, uid)
        return KubernetesSandbox(self, api, name, uid, watch)

    async def _create(self, api: CoreV1Api, manifest: V1Pod, budget_s: float) -> str | None:
        """The pod created (its UID when the answer says it); an unreachable API server is
        retried within the schedule budget, then `SANDBOX_CAPACITY`."""
        assert manifest.metadata is not None
        name, started, attempt = manifest.metadata.name or "", time.monotonic(), 0
        while True:
            attempt += 1
            try:
                created = await api.create_namespaced_pod(
                    self.settings.namespace, manifest, _request_timeout=_REQUEST_TIMEOUT_S
                )
                return created.metadata.uid if created.metadata else None
            except ApiException as exc:
                if exc.status == 409 and attempt > 1:
                    return await self._adopt(api, manifest)  # our own create's lost answer
                if exc.status is not None and (exc.status >= 500 or exc.status == 429):
                    problem = f"{exc.status} {exc.reason}"
                elif refused_access(exc.status or 0, exc.body or ""):
                    raise SandboxAccessDenied(
                        f"sandbox pod {name}: create refused in namespace "
                        f"{self.settings.namespace!r}: {exc.status} {exc.reason}: "
                        f"{(exc.body or '')[:300]}"
                    ) from exc
                else:
                    failure = classify_create_error(
                        exc.status or 0, exc.reason or "", exc.body or ""
                    )
                    raise _error(failure) from exc
            except _UNREACHABLE as exc:
                problem = repr(exc)
            elapsed = time.monotonic() - started
            if elapsed > budget_s:
                raise SandboxCapacity(
                    f"sandbox pod {name}: schedule phase: the create was not answered "
                    f"({problem}) (after {elapsed:.1f}s of a {budget_s:g}s budget)"
                )
            await asyncio.sleep(self._poll_s)

    async def _adopt(self, api: CoreV1Api, manifest: V1Pod) -> str | None:
        assert manifest.metadata is not None and manifest.metadata.name is not None
        pod = await api.read_namespaced_pod(manifest.metadata.name, self.settings.namespace)
        theirs = (pod.metadata.annotations or {}) if pod.metadata else {}
        ours = manifest.metadata.annotations or {}
        if theirs.get(ANNOTATION_TOKEN) != ours.get(ANNOTATION_TOKEN):
            raise SandboxStartFailed(f"sandbox pod {manifest.metadata.name} exists, not ours")
        return pod.metadata.uid if pod.metadata else None

    async def _until_ready(
        self, api: CoreV1Api, name: str, uid: str | None, budgets: SetupBudgets
    ) -> V1Pod:
        """Poll the pod through the schedule and ready phases, each on its own budget."""
        phase: Phase = "schedule"
        began = time.monotonic()
        while True:
            pod = await self._read(api, name)
            elapsed = time.monotonic() - began
            verdict = classify_start(
                pod, phase=phase, elapsed_s=elapsed, budgets=budgets, uid=uid, name=name
            )
            if verdict == "ready":
                assert pod is not None
                return pod
            if isinstance(verdict, StartFailure):
                if pod is None and elapsed <= self._budget(phase, budgets):
                    verdict = None  # unreadable for now: uninspectable only at the budget
                else:
                    raise _error(verdict)
            if verdict == "started":
                phase, began = "ready", time.monotonic()
                continue
            await asyncio.sleep(self._poll_s)

    @staticmethod
    def _budget(phase: Phase, budgets: SetupBudgets) -> float:
        return budgets.schedule_s if phase == "schedule" else budgets.ready_s

    async def _read(self, api: CoreV1Api, name: str) -> V1Pod | None:
        """The pod; `None` when it cannot be read now; `SandboxLost` when it is gone."""
        try:
            return await api.read_namespaced_pod(
                name, self.settings.namespace, _request_timeout=_REQUEST_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status == 404:
                raise SandboxLost(f"sandbox pod {name}: deleted while it started") from exc
            log.warning("sandbox pod %s: read failed: %s %s", name, exc.status, exc.reason)
        except _UNREACHABLE as exc:
            log.warning("sandbox pod %s: read failed: %r", name, exc)
        return None

    async def _seed(
        self, api: CoreV1Api, spec: SandboxSpec, name: str, pod: V1Pod, uid: str
    ) -> None:
        """The seed phase: every `spec.seed_dirs` copied in, on the seed budget."""
        if not spec.seed_dirs:
            return
        budgets = spec.budgets or self.settings.budgets
        began = time.monotonic()

        async def seed_all() -> None:
            for seed in spec.seed_dirs:
                async with pack_dir(seed.host) as tar:
                    await copy_in(
                        api,
                        self.settings.namespace,
                        name,
                        "sandbox",
                        tar,
                        sandbox_path(seed.sandbox),
                    )

        try:
            await asyncio.wait_for(seed_all(), budgets.seed_s)
        except TimeoutError:
            verdict = classify_start(
                pod,
                phase="seed",
                elapsed_s=time.monotonic() - began,
                budgets=budgets,
                uid=uid,
                name=name,
            )
            assert isinstance(verdict, StartFailure)
            raise _error(verdict) from None

    # -- stop ----------------------------------------------------------------------------------

    async def delete_pod(self, api: CoreV1Api, name: str, uid: str | None) -> bool:
        """Delete the pod (that UID only, when given) with the grace, then confirm it gone.
        False when there was nothing of ours to delete."""
        body = V1DeleteOptions(
            grace_period_seconds=self.settings.delete_grace_s,
            preconditions=V1Preconditions(uid=uid) if uid else None,
        )
        try:
            await api.delete_namespaced_pod(
                name, self.settings.namespace, body=body, _request_timeout=_REQUEST_TIMEOUT_S
            )
        except _UNREACHABLE as exc:
            raise SandboxError(f"sandbox pod {name}: delete not answered: {exc!r}") from exc
        except ApiException as exc:
            if exc.status in (404, 409):  # gone, or a UID that is not ours any more
                return False
            raise SandboxError(
                f"sandbox pod {name}: delete refused: {exc.status} {exc.reason}"
            ) from exc
        deadline = time.monotonic() + self.settings.gone_timeout_s
        unanswered = ""
        while time.monotonic() < deadline:
            try:
                pod = await api.read_namespaced_pod(
                    name, self.settings.namespace, _request_timeout=_REQUEST_TIMEOUT_S
                )
            except ApiException as exc:
                if exc.status == 404:
                    return True
                raise SandboxError(f"sandbox pod {name}: {exc.status} {exc.reason}") from exc
            except _UNREACHABLE as exc:  # asked again until the deadline, as `_read` does
                if not unanswered:
                    log.warning("sandbox pod %s: read after its delete failed: %r", name, exc)
                unanswered = f" (its reads not answered: {exc!r})"
            else:
                unanswered = ""
                if uid and pod.metadata is not None and pod.metadata.uid != uid:
                    return True  # ours is gone; the name was taken again
            await asyncio.sleep(self._poll_s)
        waited = f"{self.settings.gone_timeout_s:g}s after its delete"
        if unanswered:
            raise SandboxError(f"sandbox pod {name}: not confirmed gone {waited}{unanswered}")
        raise SandboxError(f"sandbox pod {name}: still there {waited}")

    async def _pods(self, run_id: str | None = None) -> list[V1Pod]:
        """runfleet's live sandbox pods (of `run_id`), filtered client-side as well."""
        api = await self.api()
        try:
            listed = await api.list_namespaced_pod(
                self.settings.namespace,
                label_selector=run_selector(run_id),
                _request_timeout=_REQUEST_TIMEOUT_S,
            )
        except ApiException as exc:
            raise SandboxError(f"sandbox pods not listed: {exc.status} {exc.reason}") from exc
        except _UNREACHABLE as exc:
            raise SandboxError(f"sandbox pods not listed: {exc!r}") from exc
        pods = []
        for pod in listed.items:
            meta = pod.metadata
            if meta is None or (meta.labels or {}).get(LABEL_MANAGED_BY) != MANAGED_BY:
                continue
            notes = meta.annotations or {}
            if ANNOTATION_RUN_ID not in notes or ANNOTATION_TOKEN not in notes:
                continue
            if run_id is not None and notes[ANNOTATION_RUN_ID] != run_id:
                continue
            pods.append(pod)
        return pods

    async def stop_others(self, run_id: str, keep_token: str) -> list[str]:
        api = await self.api()
        stopped = []
        for pod in await self._pods(run_id):
            assert pod.metadata is not None and pod.metadata.name is not None
            if (pod.metadata.annotations or {}).get(ANNOTATION_TOKEN) == keep_token:
                continue
            if await self.delete_pod(api, pod.metadata.name, pod.metadata.uid):
                stopped.append(pod.metadata.name)
        return stopped

    async def list_sandboxes(self) -> list[SandboxRef]:
        refs = []
        for pod in await self._pods():
            assert pod.metadata is not None and pod.metadata.name is not None
            if pod.metadata.deletion_timestamp is not None:
                continue  # already stopping
            notes = pod.metadata.annotations or {}
            refs.append(
                SandboxRef(notes[ANNOTATION_RUN_ID], notes[ANNOTATION_TOKEN], pod.metadata.name)
            )
        return refs
