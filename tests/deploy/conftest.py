"""The fixtures of the offline checks of `deploy/`: each build rendered once per module, and
a process environment holding exactly a workload's `RUNFLEET_*` settings."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.deploy.manifests import (
    BUILDS,
    SECRET_FILE_SETTINGS,
    Manifest,
    kubectl_binary,
    kustomize_build,
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    kubectl = kubectl_binary()
    return {name: kustomize_build(kubectl, path) for name, path in BUILDS.items()}


@pytest.fixture
def settings_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Callable[[dict[str, str]], None]:
    """Replace every RUNFLEET_* variable of this process by the given ones (a file a Secret
    mounts in the pod is a stand-in file here)."""

    def apply(env: dict[str, str]) -> None:
        for key in list(os.environ):
            if key.startswith("RUNFLEET_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            if key in SECRET_FILE_SETTINGS:
                stand_in = tmp_path / "secrets" / key
                stand_in.parent.mkdir(exist_ok=True)
                stand_in.write_text("stand-in for the mounted Secret key\n")
                value = str(stand_in)
            monkeypatch.setenv(key, value)

    return apply
