"""Parameter-server jobs for tests/ps/test_ps.py (2 servers x 2 workers), printing
``CHECK <name> <value>`` lines the tests read from the workers' logs.

- ``geo``: what a geo exchange moves (only the rows this worker changed, and the rows
  it holds that others changed), and the bounded local copy (evicted rows released,
  pulled again on use);
- ``failures`` (sync): a hashed table's admission and bound; then worker 1 finishes after 3 steps while worker 0 starts a 4th
  (a clear error within seconds, naming worker 1), then worker 0 kills server 1 and
  looks up a row it holds (an error naming the server and the table).
"""
import os
import signal
import sys
import time

import torch

import globaltensor as gt
from globaltensor import comm
from globaltensor.comm import rpc
from globaltensor.ps.hashed import hashed_normal
from globaltensor.ps.runtime import server_rank_of

JOB = sys.argv[1]
gt.ps.init(gt.ps.Strategy(mode="geo" if JOB == "geo" else "sync", k_steps=1000))
if gt.ps.is_server():
    gt.ps.run_server()
    sys.exit(0)
rank = gt.ps.worker_rank()


def check(name: str, value) -> None:
    print(f"CHECK {name} {value}", flush=True)


def barrier() -> None:  # a collective of the workers' group
    comm.all_reduce_(torch.ones(1), "sum", (0, 1))


def train(table, ids) -> None:
    table(torch.tensor(ids)).sum().backward()  # a gradient of ones on every row


def geo() -> None:
    table = gt.ps.EmbeddingTable(1000, 4, "sgd", lr=1.0, init_std=0.1, seed=5, geo_rows=45, name="t")
    # 1. disjoint rows: each worker takes back only the 40 rows it pushed
    train(table, list(range(40)) if rank == 0 else list(range(500, 540)))
    table.flush()
    check("own", table.last_exchange)
    barrier()
    # 2. worker 1 changes rows 0-4, which worker 0 holds: worker 0's next exchange
    # pushes nothing and takes back those 5 rows, with the servers' values
    if rank == 1:
        train(table, [0, 1, 2, 3, 4])
        table.flush()
    barrier()
    if rank == 0:
        table.flush()
        check("others", table.last_exchange)
        local = table(torch.arange(5)).detach()
        check("others_equal", torch.equal(local, table.weight()[:5]))
        # 3. rows 0-4 and 10-39 used again, 10 new rows trained: after the exchange
        # the copy is back to 45 rows (the coldest, rows 5-9, went)
        table(torch.tensor(list(range(5)) + list(range(10, 40))))
        train(table, list(range(100, 110)))
        table.flush()
        check("bounded", table.stats().local_rows)
    barrier()
    # 4. worker 1 changes row 7 (released by worker 0) and 105 (held by worker 0)
    if rank == 1:
        train(table, [7, 105])
        table.flush()
    barrier()
    if rank == 0:
        table.flush()  # takes back row 105 only
        check("released", table.last_exchange)
        check("repulled_equal", torch.equal(table(torch.tensor([7, 105])).detach(), table.weight()[[7, 105]]))
    gt.ps.stop_worker()


def hashed(rank: int) -> None:
    """A hashed table of 3 rows per server, count filter 2: an id reads zeros until its
    second lookup, then its initial values; 40 ids later the table still holds <= 6."""
    table = gt.ps.EmbeddingTable(None, 2, "sgd", lr=0.1, init_std=1.0, seed=9, capacity=3,
                                 admit_count=2, name="hashed")
    big = torch.tensor([2**62 + 11, -7]) + 1000 * rank  # each worker its own ids
    first, second = table(big).detach(), table(big).detach()
    for start in range(0, 40, 4):
        table(torch.arange(start, start + 4) * 1_000_003)
    if rank == 0:
        check("hashed_first_zero", bool((first == 0).all()))
        check("hashed_second", torch.equal(second, hashed_normal(big, 2, 1.0, 9)))
        check("hashed_stats", table.stats())


def failures() -> None:
    table = gt.ps.EmbeddingTable(100, 4, "sgd", lr=0.1, init_std=0.1, name="clicks")
    head = torch.nn.Linear(4, 1)
    opt = gt.ps.DenseOptimizer(head.parameters(), "sgd", lr=0.1)

    def step() -> None:
        opt.zero_grad()
        head(table(torch.tensor([rank, 60 + rank]))).sum().backward()
        opt.step()

    for _ in range(3):
        step()
    hashed(rank)
    if rank == 1:
        gt.ps.stop_worker()
        return
    start = time.perf_counter()
    try:
        step()
    except ValueError as e:
        check("early_finish", f"{time.perf_counter() - start:.1f}s {' '.join(str(e).split())}")
    os.kill(rpc.call(server_rank_of(1), os.getpid), signal.SIGKILL)
    start = time.perf_counter()
    try:
        table(torch.tensor([70]))  # a row of server 1
    except gt.ps.ServerError as e:
        check("dead_server", f"{time.perf_counter() - start:.1f}s {' '.join(str(e).split())}")
    os._exit(3)


geo() if JOB == "geo" else failures()
