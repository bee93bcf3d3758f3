"""Geo-mode job for tests/ps/test_ps.py (2 servers x 2 workers), printing ``CHECK
<name> <value>`` lines the test reads from worker 0's log: what a geo exchange moves
(only the rows this worker changed, and the rows it holds that others changed), and
the bounded local copy (evicted rows released, pulled again on use)."""
import sys

import torch

import globaltensor as gt
from globaltensor import comm

gt.ps.init(gt.ps.Strategy(mode="geo", k_steps=1000))
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


geo()
