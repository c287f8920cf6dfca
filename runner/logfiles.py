"""Size-capped runner logs under `RUNFLEET_DATA/logs/` for `runfleet up`.

A runner writes its log through the stdout and stderr it was started with, an append-mode file
that `up` opened, so a crash's traceback lands there as well as what it logs. `up` caps each
file by copy-and-truncate (logrotate's `copytruncate`): the full file is copied to `NAME.1`
(older copies shift to `.2` … `.KEEP`, the oldest dropped) and then cut to zero length. Because
the runner's descriptor is in append mode, its next line lands at the new end; lines it writes
between the copy and the cut (microseconds) are the only ones that can be lost. Renaming instead
would leave the runner writing into `NAME.1` until it restarts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LOG_MAX_BYTES = 10 * 1024 * 1024
"""A runner log past this size is rotated (checked about twice a second)."""
LOG_KEEP = 3
"""How many rotated copies are kept beside the live file (`NAME.1` is the newest)."""


def rotated(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def rotate_if_large(path: Path, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> bool:
    """Rotate `path` when it has reached `max_bytes`; True when it did. A missing file, or one
    that cannot be copied (a full disk), is left as it is: the runner's log is never the reason
    a fleet stops."""
    try:
        if path.stat().st_size < max_bytes:
            return False
        rotated(path, keep).unlink(missing_ok=True)
        for i in range(keep - 1, 0, -1):
            if rotated(path, i).exists():
                rotated(path, i).rename(rotated(path, i + 1))
        shutil.copyfile(path, rotated(path, 1))
        os.truncate(path, 0)
    except OSError:
        return False
    return True
