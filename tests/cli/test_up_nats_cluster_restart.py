"""`runfleet up --nats-cluster 3`, as an operator runs it for weeks (found by a cluster
walkthrough): a node that dies is started again by `up` (same ports and JetStream directory:
it catches up from its peers), said on `up`'s output, its log and the view; and `up` stopped
with Ctrl-C starts again on the same data dir. It used to exit `nats_timeout` nearly every
time, at its first stream lookup, because a cluster that answers healthy can still have
streams without a leader for a few seconds; the runs it had handed off waited for a fleet."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.cli.conftest import Up, cmdline, eventually, stop_cleanly

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello.yaml"
CLUSTER = ("--nats-cluster", "3")


def _node_pid(up: Up, node: str) -> int:
    (pid,) = [
        p
        for p in up.track()
        if "nats-server" in cmdline(p) and f"--server_name {node} " in cmdline(p) + " "
    ]
    return pid


# Three `up` starts on a 3-node cluster, each waiting out its leader elections, and two runs:
# over the suite's 120 s when the machine is loaded (the xdist workers' other tests).
@pytest.mark.timeout(400)
def test_up_on_a_nats_cluster_restarts_a_dead_node_and_starts_again_on_its_data_dir(
    tmp_path: Path,
) -> None:
    up = Up.start(tmp_path, runners=1, args=CLUSTER)
    try:
        first = up.launch(HELLO)["run_id"]
        up.wait_status(first, "finished", within=60)
        mark = len(up.output())
        dead = _node_pid(up, "n2")
        os.kill(dead, signal.SIGKILL)
        eventually(
            lambda: "nats-server n2 restarted on port" in up.output()[mark:],
            within=60,
            what="node n2 restarted",
        )
        assert "nats-server n2 killed by SIGKILL" in (up.data / "logs" / "up.log").read_text()
        assert _node_pid(up, "n2") != dead
    finally:
        stop_cleanly(up)
    for round_ in range(2):  # each start on the stopped cluster's data dir must come up
        again = Up.start(tmp_path, runners=1, args=CLUSTER)
        try:
            run = again.launch(HELLO)["run_id"]
            again.wait_status(run, "finished", within=90)
            assert again.status(first)["status"] == "finished", round_
        finally:
            stop_cleanly(again)


def test_up_without_nats_cluster_on_a_clusters_data_dir_says_what_it_does_not_read(
    tmp_path: Path,
) -> None:
    """A cluster walkthrough: `up` without `--nats-cluster` on a cluster's data dir started a
    fresh single server without a word; what the cluster held stayed unseen."""
    (tmp_path / "data" / "nats-cluster" / "n1").mkdir(parents=True)
    up = Up.start(tmp_path, runners=1)
    try:
        assert "warning:" in up.output()
        assert "nats-cluster holds the JetStream data of an earlier `up` with --nats-cluster N" in (
            up.output()
        )
    finally:
        stop_cleanly(up)
