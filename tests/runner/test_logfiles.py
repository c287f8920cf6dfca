"""Runner logs under `up` are capped by copy-and-truncate (runner/logfiles.py)."""

from __future__ import annotations

from pathlib import Path

from runner.logfiles import rotate_if_large, rotated


def test_a_log_past_its_cap_is_copied_aside_and_the_writer_goes_on_at_its_start(
    tmp_path: Path,
) -> None:
    log = tmp_path / "runner-0.log"
    with log.open("ab", buffering=0) as writer:  # as `up` hands it to the runner
        writer.write(b"x" * 100 + b"\n")
        assert rotate_if_large(log, max_bytes=50)
        writer.write(b"after the cut\n")
    assert rotated(log, 1).read_bytes() == b"x" * 100 + b"\n"
    assert log.read_bytes() == b"after the cut\n"  # no hole of zeros: append mode


def test_a_log_under_its_cap_is_left_alone(tmp_path: Path) -> None:
    log = tmp_path / "runner-0.log"
    log.write_bytes(b"short\n")
    assert not rotate_if_large(log, max_bytes=50)
    assert log.read_bytes() == b"short\n"
    assert not rotated(log, 1).exists()


def test_rotated_copies_shift_and_the_oldest_past_keep_is_dropped(tmp_path: Path) -> None:
    log = tmp_path / "runner-0.log"
    for n in range(4):
        log.write_bytes(f"generation {n}\n".encode() * 10)
        assert rotate_if_large(log, max_bytes=10, keep=2)
    assert rotated(log, 1).read_bytes().startswith(b"generation 3")
    assert rotated(log, 2).read_bytes().startswith(b"generation 2")
    assert not rotated(log, 3).exists()


def test_a_missing_log_is_not_an_error(tmp_path: Path) -> None:
    assert not rotate_if_large(tmp_path / "absent.log", max_bytes=1)
