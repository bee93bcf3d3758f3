"""Parameter-server job for tests/ps/test_ps.py: a table's rows and lazy-Adam state
saved with get_state_dict + dcp.save (``save DIR``: 4 steps, save, 3 more steps, write
the result), then loaded into a job with another number of servers (``load DIR``: load,
the same 3 steps, compare with the saved job's result)."""
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import globaltensor as gt

phase, path = sys.argv[1], sys.argv[2]
gt.ps.init(gt.ps.Strategy(mode="sync"))
if gt.ps.is_server():
    gt.ps.run_server()
    sys.exit(0)
rank = gt.ps.worker_rank()
model = torch.nn.Module()
model.emb = gt.ps.EmbeddingTable(50, 3, "adam", lr=0.05, init_std=0.1, seed=4, name="emb")
torch.manual_seed(0)
model.head = torch.nn.Linear(3, 1)
opt = gt.ps.DenseOptimizer(model.head.parameters(), "adam", lr=0.05)


def step(i: int) -> None:
    g = torch.Generator().manual_seed(100 * i + rank)
    ids = torch.randint(0, 50, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.softplus(model.head(model.emb(ids))).mean().backward()
    opt.step()


def result() -> dict:
    return {"emb": model.emb.weight(), **{k: v.detach().clone() for k, v in model.head.named_parameters()}}


if phase == "save":
    for i in range(4):
        step(i)
    model_sd, optim_sd = get_state_dict(model, opt.local)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=gt.ps.worker_group())
    for i in range(4, 7):
        step(i)
    if rank == 0:
        torch.save(result(), f"{path}/expected.pt")
else:
    start = result()
    model_sd, optim_sd = get_state_dict(model, opt.local)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=gt.ps.worker_group())
    set_state_dict(model, opt.local, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for i in range(4, 7):
        step(i)
    if rank == 0:
        expected, ours = torch.load(f"{path}/expected.pt"), result()
        print("CHECK max_diff", max(float((ours[k] - expected[k]).abs().max()) for k in expected))
        print("CHECK moved", float((ours["emb"] - start["emb"]).abs().max()))
gt.ps.stop_worker()
