"""The settings the manifests give the runner and the API (SPEC §11, §12): every `RUNFLEET_*`
name is read by a settings class (or directly) and every value parses with its relations; the
store and blob URLs come from Secrets (the same keys for both), and no Secret is committed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engine.config import EngineSettings
from engine.sandbox.kubernetes.settings import KubernetesSandboxSettings
from publisher.config import WireSettings
from runner.config import RunnerSettings
from runner.console.auth import TOKENS_FILE
from store.config import StoreSettings
from tests.deploy.manifests import (
    OVERLAYS,
    Manifest,
    find,
    only_container,
    runner_deployment,
    workload,
    workload_env,
)

SETTINGS_CLASSES = (
    RunnerSettings,
    EngineSettings,
    WireSettings,
    StoreSettings,
    KubernetesSandboxSettings,
)
# Read from the environment directly (store/blob_url.py; the API's token file,
# runner/console/auth.py), not through a settings class.
DIRECT_ENV_SETTINGS = frozenset({"RUNFLEET_S3_ENDPOINT", "RUNFLEET_S3_REGION", TOKENS_FILE})


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("which", ["runner", "api"])
def test_manifests_set_only_known_settings_with_valid_values(
    rendered: dict[str, list[Manifest]],
    overlay: str,
    which: str,
    settings_env: Callable[[dict[str, str]], None],
) -> None:
    env = workload_env(rendered[overlay], which)
    known = {f"RUNFLEET_{field.upper()}" for cls in SETTINGS_CLASSES for field in cls.model_fields}
    known |= DIRECT_ENV_SETTINGS
    unknown = {k for k in env if k.startswith("RUNFLEET_")} - known
    assert not unknown, f"no settings class reads {sorted(unknown)} (a typo?)"
    settings_env(env)
    for cls in SETTINGS_CLASSES:
        cls()  # each parses its variables and checks its relations (SPEC §12)


def secret_env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's variables read from a Secret key: name → its `secretKeyRef`."""
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("which", ["runner", "api"])
def test_store_and_blob_urls_come_from_secrets(
    rendered: dict[str, list[Manifest]], overlay: str, which: str
) -> None:
    """A fleet shares one store and blob store; never the per-pod SQLite/file defaults, and
    never a credential-bearing URL in a ConfigMap. The API reads the runners' (same Secret
    keys): it must see the runs the runners write."""
    manifests = rendered[overlay]
    from_secrets = secret_env(only_container(workload(manifests, which)))
    runners = secret_env(only_container(runner_deployment(manifests)))
    for name in ("RUNFLEET_STORE_URL", "RUNFLEET_BLOB_URL"):
        assert name in from_secrets and not from_secrets[name].get("optional")
        assert name not in workload_env(manifests, which)
        assert from_secrets[name] == runners[name]
    assert not find(manifests, "Secret"), "secrets are created out of band, never committed"
