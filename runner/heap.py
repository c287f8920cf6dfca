"""The runner process's heap after start-up: frozen out of the garbage collector's sight.

A runner process imports pydantic, the kubernetes client, aiohttp and nats before it serves its
first delivery: ≈ 96 000 tracked objects that live as long as the process. CPython's full
(generation 2) collection walks all of them, and a busy runner triggers one every few seconds.
Measured in `bench.latency` (2 runners x 16 slots, 50 % load): 9 full collections per runner,
60 ms each on average, 121 ms at worst. Every delivery in the process waits that long, which is
most of the p99 (issue 19, docs/performance.md).

`gc.freeze()` moves every object alive at that moment into the permanent generation, which no
collection walks again; objects made afterwards are collected as before (so a cycle made per
delivery is still reclaimed). The `gc` documentation gives it for servers that fork after
loading; here it serves its other effect, that no collection walks those objects again
(ADR-0016). Called once, from the entry point of each long-lived process: `runfleet runner`
after its runner started, and `runfleet console` and `runfleet up` once their API listens (a
full collection in the process that serves the API stalls every launch and resume in flight;
ADR-0016 amendment 1). Never from the `Runner` class or the API's app: a test or a host process
that embeds them owns its own heap.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze the rest; the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
