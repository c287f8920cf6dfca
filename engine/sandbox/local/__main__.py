"""`python -m engine.sandbox.local RECORD [GRACE_S]`: the sandbox watchdog process."""

from engine.sandbox.local.watchdog import main

raise SystemExit(main())
