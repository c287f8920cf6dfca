"""Drivers are found by name in one registry (SPEC §7.1, v2.2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.sandbox import (
    DriverContext,
    LocalSandboxDriver,
    SandboxDriver,
    SandboxError,
    UnknownSandboxDriver,
    driver_names,
    open_driver,
)


def test_drivers_are_found_by_name_in_one_registry(tmp_path: Path) -> None:
    driver = open_driver("local", DriverContext(data_dir=tmp_path))
    assert isinstance(driver, LocalSandboxDriver)
    assert isinstance(driver, SandboxDriver)
    assert driver.record_path("r", "t") == tmp_path.absolute() / "sandboxes" / "r" / "t.json"
    assert "local" in driver_names()


def test_an_unknown_driver_is_a_typed_error_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(UnknownSandboxDriver) as raised:
        open_driver("kubernets", DriverContext(data_dir=tmp_path))
    error = raised.value
    assert error.code == "unknown_sandbox_driver"
    assert error.name == "kubernets"
    assert error.known == driver_names()
    assert all(name in error.message for name in driver_names())
    assert error.remedy is not None and "local" in error.remedy
    # A configuration error, never a sandbox failure an execution would turn into a node failure.
    assert not isinstance(error, SandboxError)
