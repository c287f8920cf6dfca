"""The `kubernetes` sandbox driver: one pod per execution (SPEC §7.1, §7.2).

- `settings.py`: the driver's settings (`RUNFLEET_SANDBOX_*`, read through `EngineSettings`)
  and the workflow's `sandbox.options` it accepts; no client import, so the loader can check
  options without loading the kubernetes client;
- `pod.py`: a pure builder of the pod, validated with the client's own models;
- `classify.py`: a pure function from a pod (and its events) to a start verdict;
- `exec.py`: commands and tar copies over the exec subresource's websocket;
- `watch.py`: the continuity watch that reports a lost pod;
- `driver.py`: `KubernetesSandboxDriver` / `KubernetesSandbox`, the I/O that ties them together.

Nothing here is imported by `engine.sandbox` itself: the registry imports `driver.py` only when
the driver is chosen, so a local fleet never loads the kubernetes client.
"""
