"""The operator surface (SPEC §10) against a real embedded fleet: `runfleet up` as a process
(its own nats-server, streams, two runner processes, SQLite under `RUNFLEET_DATA`), and every
other command as a `runfleet` subprocess that finds the fleet through `$DATA/nats.url`.

One fleet serves the whole `tests/cli` session (each `up` costs a start and a drain); a test
that stops or breaks a fleet starts its own with `start_up`. Short lease and sweeper settings
keep it fast without changing a rule (they are checked against the settings classes before the
fleet starts), and `RUNFLEET_MAX_DELIVER=2` lets a transient failure reach the DLQ on its second
delivery. Waits poll with a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from engine.config import EngineSettings
from publisher import WireNames
from publisher.config import WireSettings
from runner.config import RunnerSettings

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
RUNFLEET = Path(sys.executable).parent / "runfleet"
CLI_TIMEOUT_S = 60.0
START_WITHIN_S = 30.0

FAST: dict[str, str] = {
    "RUNFLEET_LEASE_TTL": "3s",
    "RUNFLEET_LEASE_INTERVAL": "1s",
    "RUNFLEET_LEASE_SKEW": "0.5s",
    "RUNFLEET_LEASE_LOSS_MARGIN": "0.5s",
    "RUNFLEET_SWEEPER_INTERVAL": "1s",
    "RUNFLEET_SWEEPER_GRACE": "3s",
    "RUNFLEET_DUPLICATE_WINDOW": "30s",
    "RUNFLEET_PUBLISH_RETRY_BUDGET": "2s",
    "RUNFLEET_TRANSIENT_DELAY": "0.2s",
    "RUNFLEET_MAX_DELIVER": "2",
    # The unwind ceiling is derived from these (SPEC §5.4): 10+5+20+10+5 = 50 s, so `up`'s
    # shutdown grace (ceiling + 30 s) fits in a test.
    "RUNFLEET_NODE_CANCEL_BUDGET": "10s",
    "RUNFLEET_TEARDOWN_BUDGET": "20s",
    "RUNFLEET_SCRATCH_BANK_BUDGET": "15s",
    "RUNFLEET_POST_ENGINE_BUDGET": "10s",
    "RUNFLEET_UNWIND_MARGIN": "5s",
}

# What the settings classes must read back from FAST: a misspelt or ignored variable would
# silently leave a 30 s default in place and turn every wait below into a timeout.
Expectation = tuple[type[Any], str, object]  # (settings class, field, value)
_EXPECTED: list[Expectation] = [
    (EngineSettings, "lease_ttl", timedelta(seconds=3)),
    (EngineSettings, "lease_interval", timedelta(seconds=1)),
    (EngineSettings, "lease_skew", timedelta(seconds=0.5)),
    (EngineSettings, "lease_loss_margin", timedelta(seconds=0.5)),
    (EngineSettings, "unwind_ceiling", timedelta(seconds=50)),
    (WireSettings, "lease_ttl", timedelta(seconds=3)),
    (WireSettings, "lease_skew", timedelta(seconds=0.5)),
    (WireSettings, "sweeper_interval", timedelta(seconds=1)),
    (WireSettings, "sweeper_grace", timedelta(seconds=3)),
    (WireSettings, "duplicate_window", timedelta(seconds=30)),
    (WireSettings, "publish_retry_budget", timedelta(seconds=2)),
    (WireSettings, "max_deliver", 2),
    (RunnerSettings, "transient_delay", timedelta(seconds=0.2)),
]

# The line `runfleet runner` logs once it consumes (`… INFO runner.runner runner <host:pid>: N
# slots, http :P`).
READY = re.compile(r" runner (?P<owner>\S+): \d+ slots, http :\d+$", re.MULTILINE)


def check_settings_accepted(env: dict[str, str], also: Sequence[Expectation] = ()) -> None:
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("RUNFLEET_")]:
            mp.delenv(key)
        for key, value in env.items():
            if key.startswith("RUNFLEET_"):
                mp.setenv(key, value)
        overridden = {(cls, name) for cls, name, _ in also}
        kept = [e for e in _EXPECTED if (e[0], e[1]) not in overridden]
        for cls, name, want in [*kept, *also]:
            got = getattr(cls(), name)
            assert got == want, f"{cls.__name__}.{name} = {got!r}, expected {want!r} from env"


def eventually(
    probe: Callable[[], T | None], *, within: float, every: float = 0.1, what: str = ""
) -> T:
    """Poll `probe` until it returns something truthy; fail at the deadline with the last
    value seen."""
    deadline = time.monotonic() + within
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {within}s; last: {last!r}")
        time.sleep(every)


# -- processes ---------------------------------------------------------------------------------


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a live process, None when it is gone."""
    raw = _read(f"/proc/{pid}/stat").decode(errors="replace")
    if not raw:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def children_of(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] == pid and st[0] != "Z":
                out.add(int(entry))
    return out


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


def has_open(pid: int, path: Path) -> bool:
    """Whether process `pid` holds `path` open (so it has started using it)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def processes_of(data: Path) -> dict[int, str]:
    """Every live process that belongs to the fleet in `data`: its path in the command line,
    the environment (RUNFLEET_DATA, a sandbox's workspace and scratch) or the cwd."""
    needle = str(data)
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or not alive(int(entry)):
            continue
        pid = int(entry)
        args = cmdline(pid)
        environ = _read(f"/proc/{pid}/environ").decode(errors="replace")
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        if needle in args or needle in environ or cwd.startswith(needle):
            found[pid] = args
    return found


# -- one `runfleet up` -------------------------------------------------------------------------


def fleet_env(data: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env.update(FAST)
    env["RUNFLEET_DATA"] = str(data)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def ready_owners(data: Path, index: int) -> list[str]:
    """The owners (`host:pid`) of each start of runner `index` of the fleet on `data`."""
    try:
        text = (data / "logs" / f"runner-{index}.log").read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [m.group("owner") for m in READY.finditer(text)]


@dataclass
class Up:
    """A running `runfleet up --runners N --slots 4 --no-view --data DATA`."""

    data: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    out_path: Path
    runners: int
    seen: set[int] = field(default_factory=set)
    """Every child pid of `up` observed (nats-server, runner processes, restarted ones)."""
    ready_before: list[int] = field(default_factory=list)
    """Each runner's ready lines in its log before this start (an earlier `up`'s)."""

    @classmethod
    def start(
        cls,
        tmp: Path,
        *,
        runners: int = 2,
        extra: dict[str, str] | None = None,
        expect: Sequence[Expectation] = (),
        command: Sequence[str] = (str(RUNFLEET),),
        args: Sequence[str] = (),
    ) -> Up:
        """Start `up` and wait until both runners consume; `expect` names what `extra` must
        set in the settings classes; `command` is what runs the CLI (the installed script);
        `args` are more options of `up` (`--nats-cluster 3`)."""
        tmp.mkdir(parents=True, exist_ok=True)
        data = tmp / "data"
        env = fleet_env(data, extra)
        check_settings_accepted(env, expect)
        out_path = tmp / "up.out"
        # Ready lines of an earlier `up` on this data dir are in the same logs: only a new one
        # says this start's runner consumes (counting the old ones, a second start on a
        # cluster's data dir "was ready" while its streams still elected). Counted before the
        # start, so this start's own line is never among them.
        before = [len(ready_owners(data, i)) for i in range(runners)]
        with out_path.open("wb") as out:
            proc = subprocess.Popen(
                [
                    *(*command, "up", "--runners", str(runners), "--slots", "4"),
                    *("--no-view", "--data", str(data)),
                    *args,
                ],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own process group, as a shell gives a foreground job: `stop` then sends
                # Ctrl-C the way a terminal does, to the whole group.
                start_new_session=True,
            )
        up = cls(data, env, proc, out_path, runners, ready_before=before)
        try:
            eventually(up._ready, within=START_WITHIN_S, what="`runfleet up` ready")
        except BaseException:
            up.kill()
            raise
        up.track()
        return up

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"`runfleet up` exited:\n{self.output()}"
        return (self.data / "nats.url").is_file() and all(
            len(self.ready_lines(i)) > self.ready_before[i] for i in range(self.runners)
        )

    # -- what it shows ----------------------------------------------------------------------

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def runner_log(self, index: int) -> str:
        return (self.data / "logs" / f"runner-{index}.log").read_text(errors="replace")

    def ready_lines(self, index: int) -> list[str]:
        """The owners (`host:pid`) of each start of runner `index`, in order."""
        return ready_owners(self.data, index)

    def owners(self) -> set[str]:
        """Every runner identity (`host:pid`) this fleet has started."""
        return {owner for i in range(self.runners) for owner in self.ready_lines(i)}

    @property
    def nats_url(self) -> str:
        return (self.data / "nats.url").read_text().strip()

    @property
    def names(self) -> WireNames:
        return WireNames("")

    def track(self) -> set[int]:
        """Record (and return) the current children of `up`."""
        kids = children_of(self.proc.pid)
        self.seen |= kids
        return kids

    def runner_pids(self) -> set[int]:
        return {pid for pid in self.track() if " -m runner runner " in f"{cmdline(pid)} "}

    # -- commands ---------------------------------------------------------------------------

    def cli(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = CLI_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(RUNFLEET), *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def ok(self, *args: str) -> dict[str, Any]:
        """Run a command with `--json`; it must exit 0 and print one JSON object."""
        result = self.cli(*args, "--json")
        assert result.returncode == 0, (args, result.returncode, result.stdout, result.stderr)
        loaded = json.loads(result.stdout)
        assert isinstance(loaded, dict)
        return loaded

    def status(self, run_id: str) -> dict[str, Any]:
        return self.ok("status", run_id)

    def wait_status(self, run_id: str, *statuses: str, within: float = 30.0) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            run = self.status(run_id)
            return run if run["status"] in statuses else None

        return eventually(probe, within=within, every=0.2, what=f"run {run_id} in {statuses}")

    def launch(self, workflow: Path | str, *pairs: str) -> dict[str, Any]:
        args = ["launch", str(workflow)]
        for pair in pairs:
            args += ["--var", pair]
        return self.ok(*args)

    def events(self, run_id: str) -> list[dict[str, Any]]:
        loaded = self.ok("events", run_id)
        events = loaded["events"]
        assert isinstance(events, list)
        return events

    def records(self) -> list[dict[str, Any]]:
        records = self.ok("dlq", "list")["records"]
        assert isinstance(records, list)
        return records

    def peek(self) -> StorePeek:
        """A read-only view of the store file, fast enough to poll in a tight loop."""
        return StorePeek(self.data / "runs.db")

    def publish_raw(self, body: bytes, headers: dict[str, str] | None = None) -> int:
        """Publish bytes no runner can decode on the runs subject; returns its stream seq."""
        return asyncio.run(_publish_raw(self.nats_url, self.names, body, headers))

    # -- stop -------------------------------------------------------------------------------

    def stop(self, within: float) -> int:
        """Ctrl-C (SIGINT) as a terminal sends it, to `up`'s whole process group; wait, and
        return the exit code."""
        self.track()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"`runfleet up` still running {within}s after SIGINT:\n{self.output()}"
                f"\n{self.diagnosis()}"
            ) from None

    def diagnosis(self, lines: int = 30) -> str:
        """What a stop that hangs needs explained: the fleet's processes still alive and the
        end of each runner's log (a CI run once saw `up` hang after "stopping", with nothing
        else to go on)."""
        alive_now = self.leftovers()
        out = [f"still alive: {alive_now or 'none'}"]
        for index in range(self.runners):
            try:
                tail = self.runner_log(index).splitlines()[-lines:]
            except FileNotFoundError:
                tail = ["(no log)"]
            out.append(f"-- runner-{index}.log, last {len(tail)} lines:")
            out.extend(tail)
        return "\n".join(out)

    def leftovers(self) -> dict[int, str]:
        """Processes of this fleet still alive: any `up` child seen, or any process of DATA."""
        left = processes_of(self.data)
        for pid in self.seen:
            if alive(pid):
                left.setdefault(pid, cmdline(pid))
        return left

    def kill(self) -> None:
        """Last resort (a failed start or a failed test): nothing of this fleet may survive."""
        for pid in set(self.leftovers()) | self.track():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class StorePeek:
    """Reads the run documents and events the fleet wrote straight from the SQLite file
    (read-only; WAL lets it read while the fleet writes). Only for waits that a `runfleet`
    process, a second per call, is too slow to observe."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)

    def close(self) -> None:
        self.conn.close()

    def attempts(self, run_ids: list[str]) -> dict[str, int]:
        marks = ",".join("?" * len(run_ids))
        rows = self.conn.execute(f"SELECT run_id, doc FROM runs WHERE run_id IN ({marks})", run_ids)
        return {run_id: int(json.loads(doc)["attempt"]) for run_id, doc in rows}

    def queued_kinds(self, run_ids: list[str]) -> dict[str, list[str]]:
        """Each run's `run_queued` kinds, in order."""
        marks = ",".join("?" * len(run_ids))
        rows = self.conn.execute(
            f"SELECT run_id, doc FROM events WHERE run_id IN ({marks}) ORDER BY run_id, seq",
            run_ids,
        )
        out: dict[str, list[str]] = {run_id: [] for run_id in run_ids}
        for run_id, doc in rows:
            event = json.loads(doc)
            if event["type"] == "run_queued":
                out[run_id].append(event["data"]["kind"])
        return out


async def _publish_raw(
    url: str, names: WireNames, body: bytes, headers: dict[str, str] | None = None
) -> int:
    import nats

    nc = await nats.connect(url)
    try:
        ack = await nc.jetstream().publish(
            names.runs_subject, body, stream=names.runs_stream, headers=headers
        )
        return int(ack.seq)
    finally:
        await nc.close()


STOP_WITHIN_S = 50.0 + 30.0
"""`up` drains its runners for at most the unwind ceiling + 30 s (FAST: ceiling 50 s)."""


def stop_cleanly(up: Up) -> None:
    try:
        rc = up.stop(STOP_WITHIN_S)
        assert rc == 0, f"`runfleet up` exited {rc}:\n{up.output()}"
        left = up.leftovers()
        assert not left, f"processes left behind by `runfleet up`: {left}"
    finally:
        up.kill()


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """One embedded fleet for the session: stopped with Ctrl-C at the end, which must exit 0
    and leave no process of the fleet behind."""
    up = Up.start(tmp_path_factory.mktemp("fleet"))
    try:
        yield up
    finally:
        stop_cleanly(up)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """Where a test writes its workflow files and the files its nodes wait for."""
    return tmp_path


HOLD = """\
# `wait` runs until the file named by `release` exists.
name: hold
entry: wait
vars:
  release:
    type: string
nodes:
  wait:
    kind: tool
    run: "while [ ! -e {{ vars.release }} ]; do sleep 0.05; done; echo released"
    timeout: 10m
    retry:
      max: 0
  after:
    kind: compute
    set:
      done: "'yes'"
edges:
  - from: wait
    to: after
"""

TEMPFAIL = """\
# `work` exits 75 (EX_TEMPFAIL: TOOL_FAILED_TRANSIENT) until the file named by `fix` exists;
# no in-process retries, so each failure reaches the disposition.
name: tempfail
entry: work
vars:
  fix:
    type: string
nodes:
  work:
    kind: tool
    run: "test -e {{ vars.fix }} || exit 75; echo fixed"
    timeout: 1m
    retry:
      max: 0
"""


def write_workflow(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


REFUSED_WITHIN_S = 30.0
"""A refusal comes before anything starts: seconds at most. A command still running after this
started something."""


def run_to_exit(
    data: Path, args: Sequence[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """`runfleet ARGS` on `data`, to its exit. One still running after REFUSED_WITHIN_S did not
    refuse: it is killed with whatever it started (its nats-server and runners live in their
    own sessions), and the test fails."""
    proc = subprocess.Popen(
        [str(RUNFLEET), *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=REFUSED_WITHIN_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in processes_of(data):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"`runfleet {args[0]}` did not refuse; it ran:\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def runfleet_with(
    env: dict[str, str], *args: str, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """`runfleet ARGS` in a shell whose environment is exactly `env`, no terminal."""
    return subprocess.run(
        [str(RUNFLEET), *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def runfleet_without_fleet(
    tmp_path: Path, *args: str, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """`runfleet ARGS` pointed at a NATS address where nothing listens, with a data dir of its
    own: for flags judged before anything is opened (reaching NATS would be exit 4, not 2)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFLEET_")}
    env["RUNFLEET_DATA"] = str(tmp_path / "data")
    env["RUNFLEET_NATS_URL"] = "nats://127.0.0.1:1"  # nothing there: never a real fleet
    return runfleet_with(env, *args, cwd=cwd)


def run_hello_without_fleet(tmp_path: Path) -> str:
    """`runfleet run examples/hello.yaml` in its own data dir (no fleet): the run's id."""
    ran = runfleet_without_fleet(tmp_path, "run", str(ROOT / "examples" / "hello.yaml"), "--json")
    assert ran.returncode == 0, ran.stderr
    run_id: str = json.loads(ran.stdout)["run_id"]
    return run_id
