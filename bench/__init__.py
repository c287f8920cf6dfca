"""Benchmarks, run by hand (not in CI; `tests/bench` only proves each script still runs).

Each script starts its own `nats-server` and SQLite store in a temporary directory, prints a
result table and one `SUMMARY` line, and takes `--quick` (tiny sizes). Absolute numbers depend on
the machine and on whatever else runs on it, so every script measures its baseline in the same
run and reports ratios. See `docs/performance.md` for the commands and the results.

    python -m bench.throughput   # capacity: raw JetStream vs runfleet, drain and end-to-end
    python -m bench.latency      # publish → claim / finished, low load and 50 % of capacity
    python -m bench.recovery     # SIGKILL adoption and SIGTERM handoff vs the lease TTL
    python -m bench.lease        # one runner holding M in-flight runs: refresh cost, CPU, RSS
"""
