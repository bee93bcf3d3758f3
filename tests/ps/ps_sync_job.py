"""Sync-mode jobs for tests/ps/test_ps.py, printing ``CHECK <name> <value>`` lines the
tests read from worker 0's log.

``save DIR`` (2 servers): 4 steps of a table with lazy Adam, a hashed table with Adagrad
and a dense head; save with get_state_dict(model, DenseOptimizer) + dcp.save; 3 more steps, whose result (and
the hashed table's counts at the save) goes to DIR/expected.pt. Then, in
the same job: a hashed table's admission and bound; worker 1 finishes while worker 0
starts another step (a clear error within seconds, naming worker 1); worker 0 kills
server 1 and looks up a row it holds (an error naming the server and the table).

``load DIR`` (any number of servers): load the checkpoint, the same 3 steps, compare
with DIR/expected.pt.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import globaltensor as gt
from globaltensor.comm import rpc
from globaltensor.ps.hashed import hashed_normal
from globaltensor.ps.runtime import server_rank_of

phase, path = sys.argv[1], sys.argv[2]
gt.ps.init(gt.ps.Strategy(mode="sync"))
if gt.ps.is_server():
    gt.ps.run_server()
    sys.exit(0)
rank = gt.ps.worker_rank()
model = torch.nn.Module()
model.emb = gt.ps.EmbeddingTable(50, 3, "adam", lr=0.05, init_std=0.1, seed=4, name="emb")
# hashed, raw ids; room for every id on 2 or 3 servers (eviction after a load: test_ps's
# shard-level test)
model.tags = gt.ps.EmbeddingTable(None, 3, "adagrad", lr=0.1, init_std=0.1, seed=5, capacity=64, name="tags")
TAGS = torch.arange(40) * 1_000_003 - 2**40
torch.manual_seed(0)
model.head = torch.nn.Linear(3, 1)
opt = gt.ps.DenseOptimizer(model.head.parameters(), "adam", lr=0.05)


def check(name: str, value) -> None:
    print(f"CHECK {name} {value}", flush=True)


def step(i: int) -> None:
    g = torch.Generator().manual_seed(100 * i + rank)
    ids = torch.randint(0, 50, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.softplus(model.head(model.emb(ids) + model.tags(TAGS[ids % 40]))).mean().backward()
    opt.step()


def result() -> dict:
    return {"emb": model.emb.weight(), "tags": model.tags(TAGS).detach(),
            **{k: v.detach().clone() for k, v in model.head.named_parameters()}}


def counts() -> tuple:
    s = model.tags.stats()
    return s.rows, s.admitted, s.evicted, s.filtered


def hashed() -> None:
    """A hashed table of 3 rows per server, count filter 2: an id reads zeros until its
    second lookup, then its initial values; 40 ids later the table still holds 6."""
    table = gt.ps.EmbeddingTable(None, 2, "sgd", lr=0.1, init_std=1.0, seed=9, capacity=3,
                                 admit_count=2, name="hashed")
    big = torch.tensor([2**62 + 11, -7]) + 1000 * rank  # each worker its own ids
    first, second = table(big).detach(), table(big).detach()
    for start in range(0, 40, 4):
        table(torch.arange(start, start + 4) * 1_000_003)
    # both workers look up the same 40 ids: each is admitted at its second lookup, so the
    # stats are read only once both are done
    torch.distributed.barrier(group=gt.ps.worker_group())
    if rank == 0:
        check("hashed_first_zero", bool((first == 0).all()))
        check("hashed_second", torch.equal(second, hashed_normal(big, 2, 1.0, 9)))
        check("hashed_stats", table.stats())


def failures() -> None:
    if rank == 1:
        gt.ps.stop_worker()
        return
    start = time.perf_counter()
    try:
        step(7)
    except ValueError as e:
        check("early_finish", f"{time.perf_counter() - start:.1f}s {' '.join(str(e).split())}")
    os.kill(rpc.call(server_rank_of(1), os.getpid), signal.SIGKILL)
    start = time.perf_counter()
    try:
        model.emb(torch.tensor([40]))  # a row of server 1
    except gt.ps.ServerError as e:
        check("dead_server", f"{time.perf_counter() - start:.1f}s {' '.join(str(e).split())}")
    os._exit(3)


if phase == "save":
    for i in range(4):
        step(i)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=gt.ps.worker_group())
    saved_counts = counts()
    torch.distributed.barrier(group=gt.ps.worker_group())  # before anyone's next lookup
    for i in range(4, 7):
        step(i)
    if rank == 0:
        torch.save({"counts": saved_counts, **result()}, f"{path}/expected.pt")
    hashed()
    failures()
else:
    start = result()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=gt.ps.worker_group())
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded_counts = counts()
    torch.distributed.barrier(group=gt.ps.worker_group())  # before anyone's next lookup
    for i in range(4, 7):
        step(i)
    if rank == 0:
        expected, ours = torch.load(f"{path}/expected.pt"), result()
        check("counts", f"{loaded_counts} {expected.pop('counts')}")
        check("max_diff", max(float((ours[k] - expected[k]).abs().max()) for k in expected))
        check("moved", float((ours["emb"] - start["emb"]).abs().max()))
        check("tags_moved", float((ours["tags"] - start["tags"]).abs().max()))
    gt.ps.stop_worker()
