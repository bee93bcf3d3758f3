"""Parameter-server job for tests/ps/test_ps.py: bad input on a worker and on a server,
then worker 1 fails on purpose (``--fail``) once worker 0 has reported its checks."""
import sys

import torch

import globaltensor as gt
from globaltensor import comm
from globaltensor.comm import rpc
from globaltensor.ps import server
from globaltensor.ps.runtime import server_rank_of

gt.ps.init(gt.ps.Strategy(mode="sync"))
if gt.ps.is_server():
    gt.ps.run_server()
    print("server stopped")
    sys.exit(0)

table = gt.ps.EmbeddingTable(10, 4, init_std=1.0, seed=3)
rank = gt.ps.worker_rank()
if rank == 0:
    for bad in (torch.tensor([1, 10]), torch.tensor([-1]), torch.tensor([0.5]), torch.tensor([True])):
        try:
            table(bad)
        except (IndexError, TypeError) as e:
            print(f"CHECK worker refused {bad.tolist()}: {type(e).__name__}: {e}")
    # Straight to a server, past the worker's checks: refused there, and the server lives on.
    for rows in (torch.tensor([99]), torch.tensor([0.0]), "junk"):
        try:
            rpc.call(server_rank_of(0), server.pull, (table._rows.id, rows))
        except Exception as e:
            print(f"CHECK server refused {rows!r}: {' '.join(str(e).split())}")
    expected = gt.ps.EmbeddingTable.initial_weight(10, 4, 1.0, seed=3)[[2, 7]]
    print(f"CHECK lookup after bad input equal: {torch.equal(table(torch.tensor([2, 7])), expected)}")
# The workers meet here (a collective of the workers' group) before worker 1 fails.
done = torch.ones(1)
comm.all_reduce_(done, "sum", (0, 1))
if "--fail" in sys.argv and rank == 1:
    raise RuntimeError("planted failure on worker 1")
gt.ps.stop_worker()
print(f"worker {rank} done")
