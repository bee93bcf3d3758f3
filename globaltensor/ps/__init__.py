"""Parameter-server training: sparse tables on servers, pulled and pushed by workers.

Start a job with ``python -m globaltensor.launch --server_num 2 --worker_num 2
train.py``: every process runs ``train.py``; servers hold the rows of the sparse
tables (split by rows over the servers) and apply their optimizer; workers read
batches, pull the rows their ids need, and push the rows' gradients. Dense parameters
stay on the workers (``DenseOptimizer``). Three modes (``Strategy``): ``sync`` (equals
one process training on the global batch), ``async`` (no worker waits for another),
``geo`` (local training, changes exchanged every ``k_steps`` steps).

Example (``train.py``)::

    import torch, torch.nn.functional as F
    import globaltensor as gt

    gt.ps.init(gt.ps.Strategy(mode="sync"))
    if gt.ps.is_server():
        gt.ps.run_server()
    else:
        emb = gt.ps.EmbeddingTable(100_000, 8, optimizer="adagrad", lr=0.05, init_std=0.1)
        head = torch.nn.Linear(8, 1)
        opt = gt.ps.DenseOptimizer(head.parameters(), optimizer="adagrad", lr=0.05)
        for ids, labels in my_shard_of_the_data():
            loss = F.binary_cross_entropy_with_logits(head(emb(ids).sum(1)).squeeze(1), labels)
            opt.zero_grad(); loss.backward(); opt.step()
        gt.ps.stop_worker()

``gt.ps.Optimizer``, ``DenseOptimizer``'s former name, still works for one release and
warns (DeprecationWarning).

Transport: ``globaltensor.comm.rpc`` (``torch.distributed.rpc``, TensorPipe). See
``examples/wide_and_deep_ps.py``.
"""
from .dense import DenseOptimizer
from .optim import OPTIMIZERS
from .runtime import (
    MODES,
    ServerError,
    Strategy,
    init,
    is_server,
    is_worker,
    run_server,
    server_num,
    server_rank,
    stop_worker,
    worker_group,
    worker_num,
    worker_rank,
)
from .table import EmbeddingTable, TableStats

__all__ = ["MODES", "OPTIMIZERS", "Strategy", "init", "is_server", "is_worker", "run_server",
           "stop_worker", "worker_rank", "server_rank", "worker_num", "server_num", "EmbeddingTable",
           "TableStats", "DenseOptimizer", "ServerError", "worker_group"]


def __getattr__(name: str):
    # the former name of DenseOptimizer: kept for one release, with a warning
    if name == "Optimizer":
        import warnings
        warnings.warn("gt.ps.Optimizer is deprecated and will be removed in the next "
                      "release: it is now gt.ps.DenseOptimizer (same arguments)",
                      DeprecationWarning, stacklevel=2)
        return DenseOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
