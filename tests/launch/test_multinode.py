"""End-to-end tests of ``python -m globaltensor.launch`` with several nodes on this
machine: the rendezvous (world size, ranks and one all_reduce across the nodes), each
node on its own loopback address (--master_addr, --local_addr; gloo listens there
only), and a missing node, named and timed out (--rdzv_timeout).

Each launcher run costs a few seconds (the launcher imports torch; its workers are
forked from it), so one run checks several things at once. Every run gets its own free
port and log dir (tests/launch/launch_helpers.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from launch_helpers import SCRIPTS, env_reports, free_port, launch, launch_nodes


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    port = free_port()
    runs = launch_nodes([["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", str(port),
                          "--log_dir", str(tmp_path / f"node{node}"), str(SCRIPTS / "report_env.py"),
                          "node-arg"] for node in (0, 1)], tmp_path, timeout=100)
    for node, (code, out, err, _) in enumerate(runs):
        assert code == 0, out + err
        assert re.search(r"world size\s*:\s*4", err)
        reports = env_reports(out)
        assert sorted(reports) == [2 * node, 2 * node + 1]
        for rank, rep in reports.items():
            assert rep["WORLD_SIZE"] == "4" and rep["LOCAL_WORLD_SIZE"] == "2"
            assert rep["LOCAL_RANK"] == str(rank - 2 * node)
            assert rep["MASTER_PORT"] == str(port)
            assert rep["allreduce"] == 10.0  # 1 + 2 + 3 + 4 across both nodes
            assert f"[rank{rank}]: ENV" in out
            assert (tmp_path / f"node{node}" / f"workerlog.{rank}").is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_two_nodes_on_their_own_loopback_addresses(tmp_path: Path) -> None:
    # node 0 on 127.0.0.2 (--master_addr: the store's address, and by default its gloo
    # address), node 1 on 127.0.0.3 (--local_addr); the hostname here resolves to 127.0.0.1
    port = free_port()
    runs = launch_nodes([["--nnodes", "2", "--node_rank", str(node), "--master_addr", "127.0.0.2",
                          "--master_port", str(port), *local, "--log_dir", str(tmp_path / f"node{node}"),
                          str(SCRIPTS / "addresses.py")]
                         for node, local in ((0, []), (1, ["--local_addr", "127.0.0.3"]))], tmp_path, timeout=60)
    reports = []
    for node, (code, out, err, _) in enumerate(runs):
        assert code == 0, out + err
        assert f"local address   : 127.0.0.{2 + node}" in err, err
        reports.append(json.loads(re.search(r"SOCKETS (\{.*\})", out).group(1)))
        assert reports[node]["rank"] == node and reports[node]["sum"] == 2.0, reports[node]
        # gloo listens on the node's address only
        assert [a.split(":")[0] for a in reports[node]["listening"]] == [f"127.0.0.{2 + node}"], reports[node]
    # and the ranks' pair was made through one of these listeners (an accepted connection
    # keeps the listener's address and port; the connecting side's source the kernel picks)
    pair = [(rank, local, remote) for rank, r in enumerate(reports) for local, remote in r["connected"]
            if local in r["listening"] or remote in reports[1 - rank]["listening"]]
    assert pair, reports
    # an address that is not this machine's is refused before anything starts
    r = launch(["--nnodes", "2", "--node_rank", "1", "--local_addr", "192.0.2.1", str(SCRIPTS / "addresses.py")],
               cwd=tmp_path, timeout=30)
    assert r.returncode == 1 and "--local_addr 192.0.2.1 is not an address of this machine" in r.stderr, r.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_missing_node_is_named_and_times_out(tmp_path: Path) -> None:
    # node 0 of 2 alone (waits for node 1); node 1 of 2 alone (no node 0 to reach)
    runs = launch_nodes([["--nnodes", "2", "--node_rank", str(node), "--master_port", str(free_port()),
                          "--rdzv_timeout", "2", "--log_dir", str(tmp_path / f"log{node}"),
                          str(SCRIPTS / "report_env.py")] for node in (0, 1)], tmp_path, timeout=40)
    for code, out, err, took in runs:
        assert code == 1, out + err
        assert "Traceback" not in err and "frame #" not in err, err  # no C++ stack dump either
        assert "ENV" not in out  # no worker started
        # --rdzv_timeout 2, plus the launcher's start (a torch import: seconds on a loaded machine)
        assert took < 2 + 12, took
    err0, err1 = runs[0][2], runs[1][2]
    assert re.search(r"node 0: waiting for 1 more of 2 nodes to join at 127\.0\.0\.1:\d+ \(up to 2 s", err0), err0
    assert re.search(r"timed out after 2 s waiting for nodes .*: 1 of 2 joined; missing node_rank 1", err0), err0
    assert "node 1: connecting to the rendezvous store of node 0" in err1, err1
    assert re.search(r"node 1 could not reach node 0's rendezvous store at 127\.0\.0\.1:\d+ within 2 s", err1), err1
