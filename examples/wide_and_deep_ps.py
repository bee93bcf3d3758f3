"""Wide & deep CTR model trained with parameter servers (sync, async or geo).

    python -m globaltensor.launch --server_num 2 --worker_num 2 examples/wide_and_deep_ps.py --mode sync
    python examples/wide_and_deep_ps.py --reference        # the same training, one plain process

Paddle Fleet's parameter-server quick start, on ``gt.ps``: the sparse tables live on
the servers (rows split over them), the workers pull the rows their batch needs and
push the rows' gradients; the dense layers are data parallel among the workers.

- data: a synthetic Criteo-like click log, 13 dense features and 26 categorical
  slots whose raw values (a long-tailed space of 10^6 per slot) are hashed into
  ``--vocab`` buckets per slot (one shared id space of 26 x vocab ids). A hidden
  weight per bucket, dense coefficients and an interaction of two slots give each
  sample a click probability; labels are drawn from it, so there is signal to learn;
- model: wide = a 1-wide table (a weight per id) summed over the slots + a linear
  layer of the dense features; deep = an MLP over the concatenated ``--dim``-wide
  embeddings and the dense features; logit = wide + deep; binary cross-entropy;
- every step draws a global batch of ``--batch`` samples; worker w trains on its
  balanced share of it (what single-process training over the global batch sees).

Prints the training loss, the held-out AUC (worker 0) and each worker's examples/s.
``--reference`` trains the same model on the same data in one process with plain
torch (``nn.Embedding(sparse=True)`` and torch's optimizers); with ``--save`` both
write the final parameters, so a sync run can be compared with it.
``--slow_worker W --slow_factor F`` makes worker W sleep after each step so that its
steps take F times as long (to see that async workers do not wait for it).
``--hashed C`` trains hashed tables (``num_embeddings=None``, C rows per server, LRU;
``--admit_count``) on the raw ids instead of their buckets; ``--geo_rows`` bounds a geo
worker's copy; ``--windows N`` prints examples/s per N-th of the run.

Checkpoints and restarts: ``--checkpoint DIR --checkpoint_every N`` saves the tables
(rows and optimizer state), the dense layers and their optimizer with
``get_state_dict`` + ``dcp.save`` every N steps and starts from the newest checkpoint
in DIR; ``--kill_server_at S`` makes worker 0 kill server 0 after step S in the job's
first run, so that::

    python -m globaltensor.launch --max_restarts 1 --server_num 2 --worker_num 2 \
        examples/wide_and_deep_ps.py --checkpoint ckpt --checkpoint_every 20 --kill_server_at 30

fails at step 30 (the workers name the dead server), restarts, and resumes at step 20.
"""
from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import globaltensor as gt
from globaltensor.layout import balanced_split

DENSE, SLOTS = 13, 26  # Criteo's dense and categorical features
RAW = 1_000_000        # raw values per categorical feature before hashing


class WideAndDeep(torch.nn.Module):
    """``embedding`` (num_ids x dim) and ``wide`` (num_ids x 1): tables looked up like
    nn.Embedding (gt.ps.EmbeddingTable on workers, nn.Embedding in the reference)."""

    def __init__(self, embedding, wide, slots, dim, hidden=(64, 32), seed=0):
        super().__init__()
        self.embedding, self.wide = embedding, wide
        torch.manual_seed(seed)  # the dense layers start alike on every worker
        self.wide_dense = torch.nn.Linear(DENSE, 1)
        sizes = (slots * dim + DENSE,) + tuple(hidden)
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], 1))

    def dense_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith(("embedding.", "wide."))]

    def forward(self, ids, dense):
        """ids (batch, slots) int64, dense (batch, 13) -> logits (batch,)."""
        wide = self.wide(ids).sum(dim=(1, 2)) + self.wide_dense(dense).squeeze(1)
        deep = self.mlp(torch.cat([self.embedding(ids).flatten(1), dense], dim=1)).squeeze(1)
        return wide + deep


def make_truth(slots, vocab):
    g = torch.Generator().manual_seed(1234)
    return {"id_weight": 0.8 * torch.randn(slots * vocab, generator=g),
            "dense_coef": 0.4 * torch.randn(DENSE, generator=g),
            "factors": torch.randn(slots * vocab, 4, generator=g) / 2}


def make_batch(n, slots, vocab, generator, truth, raw_ids=False):
    """n samples: hashed ids (n, slots), dense (n, 13), labels (n,). ``raw_ids``: the
    ids are the raw values (slot s's value r is s * RAW + r: 26 x 10^6 possible ids,
    for hashed tables) instead of their buckets."""
    u = torch.rand(n, slots, generator=generator)
    raw = (u ** 3 * RAW).long()                                  # long-tailed raw values
    hashed = (raw * 2654435761 + torch.arange(slots) * 97) % vocab
    ids = hashed + torch.arange(slots) * vocab                   # one id space, per-slot blocks
    dense = torch.randn(n, DENSE, generator=generator)
    f = truth["factors"]
    logit = (truth["id_weight"][ids].sum(1) / slots ** 0.5 + dense @ truth["dense_coef"]
             + 1.5 * (f[ids[:, 0]] * f[ids[:, 1]]).sum(1) - 1.0)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=generator)
    if raw_ids:
        ids = raw + torch.arange(slots) * RAW
    return ids, dense, labels


def auc(scores, labels):
    """Area under the ROC curve (rank statistic)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=gt.ps.MODES, default="sync")
    p.add_argument("--k_steps", type=int, default=10, help="geo: steps between exchanges")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=512, help="global batch (all workers)")
    p.add_argument("--slots", type=int, default=SLOTS)
    p.add_argument("--vocab", type=int, default=1000, help="hash buckets per slot")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--optimizer", choices=gt.ps.OPTIMIZERS, default="adagrad",
                   help="the tables' optimizer (the dense layers': the same; adagrad for ftrl)")
    p.add_argument("--lr", type=float, default=0.05, help="tables' learning rate")
    p.add_argument("--dense_lr", type=float, default=0.02)
    p.add_argument("--eval_size", type=int, default=8192)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--save", default=None, help="write the final parameters here (torch.save)")
    p.add_argument("--reference", action="store_true", help="one plain-torch process")
    p.add_argument("--slow_worker", type=int, default=-1)
    p.add_argument("--slow_factor", type=float, default=2.0)
    p.add_argument("--windows", type=int, default=1, help="also print examples/s of this many equal windows")
    p.add_argument("--hashed", type=int, default=0, metavar="CAPACITY",
                   help="hashed tables (num_embeddings=None) of CAPACITY rows per server, fed raw ids")
    p.add_argument("--admit_count", type=int, default=1, help="hashed tables: count filter")
    p.add_argument("--geo_rows", type=int, default=None, help="geo: rows a worker keeps per table")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="save to DIR/step_<n> every --checkpoint_every steps; start from the newest there")
    p.add_argument("--checkpoint_every", type=int, default=50)
    p.add_argument("--kill_server_at", type=int, default=-1, metavar="STEP",
                   help="worker 0 kills server 0 (SIGKILL) after STEP steps, in the job's first run "
                        "(with the launcher's --max_restarts, the job restarts from the checkpoint)")
    return p.parse_args(argv)


def train(args, model, step_update, rank, workers, say, first_step=0, after_step=None):
    """The training loop shared by workers and the reference: returns examples/s.
    Steps before ``first_step`` (done before a restart) only draw their batch;
    ``after_step(n)`` runs after the n-th step."""
    g = torch.Generator().manual_seed(0)  # every worker draws the same global batches
    truth = make_truth(args.slots, args.vocab)
    offset, size = balanced_split(args.batch, workers)[rank]
    losses, marks = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        ids, dense, labels = make_batch(args.batch, args.slots, args.vocab, g, truth, args.hashed > 0)
        if step < first_step:
            continue
        if (step - first_step) % max(1, args.steps // args.windows) == 0:
            marks.append((step, time.perf_counter()))
        t0 = time.perf_counter()
        ids, dense, labels = (t[offset:offset + size] for t in (ids, dense, labels))
        # the mean over this worker's share; the servers and the dense all-reduce
        # average the workers (equal shares), which is the global batch's mean
        loss = F.binary_cross_entropy_with_logits(model(ids, dense), labels)
        step_update(loss)
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            say(f"step {step:4d}  loss {losses[-1]:.4f}")
        if rank == args.slow_worker:
            time.sleep((args.slow_factor - 1) * (time.perf_counter() - t0))  # simulated slow machine
        if after_step:
            after_step(step + 1)
    elapsed = time.perf_counter() - start
    if args.windows > 1:
        marks.append((args.steps, start + elapsed))
        rates = [size * (s1 - s0) / (t1 - t0) for (s0, t0), (s1, t1) in zip(marks, marks[1:])]
        print(f"worker {rank}: windows of {marks[1][0]} steps: " + " ".join(f"{r:.0f}" for r in rates)
              + " examples/s")
    k = max(1, min(10, len(losses) // 4))
    say(f"training loss: {sum(losses[:k]) / k:.4f} -> {sum(losses[-k:]) / k:.4f} "
        f"(mean of the first / last {k} steps)")
    return size * len(losses) / elapsed


def evaluate(args, model):
    truth = make_truth(args.slots, args.vocab)
    g = torch.Generator().manual_seed(99)
    ids, dense, labels = make_batch(args.eval_size, args.slots, args.vocab, g, truth, args.hashed > 0)
    with torch.no_grad():
        logits = model(ids, dense)
    return auc(logits, labels), F.binary_cross_entropy_with_logits(logits, labels).item()


def save(path, model, tables):
    state = {n: p.detach().clone() for n, p in model.named_parameters()
             if not n.startswith(("embedding.", "wide."))}
    state.update(tables)
    torch.save(state, path)


def reference(args):
    """One process, plain torch, the global batch: what sync mode must equal."""
    if args.optimizer not in ("sgd", "adagrad") or args.hashed:
        raise SystemExit("--reference trains row tables with sgd or adagrad (torch's sparse ones)")
    num_ids = args.slots * args.vocab
    emb = torch.nn.Embedding(num_ids, args.dim, sparse=True)
    wide = torch.nn.Embedding(num_ids, 1, sparse=True)
    with torch.no_grad():  # the values a gt.ps.EmbeddingTable starts with
        emb.weight.copy_(gt.ps.EmbeddingTable.initial_weight(num_ids, args.dim, 0.1, seed=1))
        wide.weight.copy_(gt.ps.EmbeddingTable.initial_weight(num_ids, 1, 0.0, seed=2))
    model = WideAndDeep(emb, wide, args.slots, args.dim)
    kind = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.Adagrad
    opts = [kind([emb.weight, wide.weight], lr=args.lr),
            kind(model.dense_parameters(), lr=args.dense_lr)]

    def update(loss):
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()

    rate = train(args, model, update, 0, 1, print)
    auc1, logloss = evaluate(args, model)
    print(f"held-out AUC {auc1:.4f}, log-loss {logloss:.4f}")
    print(f"reference: {rate:.0f} examples/s")
    if args.save:
        save(args.save, model, {"embedding.weight": emb.weight.detach().clone(),
                                "wide.weight": wide.weight.detach().clone()})


def checkpoint_state(model, opt):
    """What a checkpoint holds: the tables' rows and sparse optimizer state (their
    module state), the dense layers and their optimizer (gt.ps.DenseOptimizer's torch one)."""
    model_sd, optim_sd = get_state_dict(model, opt.local)
    return {"model": model_sd, "optim": optim_sd}


def resume(args, model, opt, say):
    """Load the newest complete checkpoint under --checkpoint, if any: the steps it holds."""
    path = gt.checkpoint.latest(args.checkpoint) if args.checkpoint else None
    if path is None:
        return 0
    state = checkpoint_state(model, opt)
    dcp.load(state, checkpoint_id=path, process_group=gt.ps.worker_group())
    set_state_dict(model, opt.local, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(os.path.basename(path).split("_")[-1])
    say(f"resumed from {path} (step {step})")
    return step


def after_step_hook(args, model, opt, rank):
    """Checkpoints every --checkpoint_every steps, and --kill_server_at's planted failure."""
    def after_step(step):
        if args.checkpoint and step % args.checkpoint_every == 0:
            dcp.save(checkpoint_state(model, opt), checkpoint_id=f"{args.checkpoint}/step_{step}",
                     process_group=gt.ps.worker_group())
        if (step == args.kill_server_at and rank == 0
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            pid = gt.comm.rpc.call(gt.ps.runtime.server_rank_of(0), os.getpid)
            print(f"worker 0: killing server 0 (pid {pid}) after step {step}", flush=True)
            os.kill(pid, signal.SIGKILL)
    return after_step


def main(argv=None):
    args = parse_args(argv)
    if args.reference:
        reference(args)
        return
    gt.ps.init(gt.ps.Strategy(mode=args.mode, k_steps=args.k_steps))
    if gt.ps.is_server():
        gt.ps.run_server()  # until every worker is done
        print(f"server {gt.ps.server_rank()}: every worker is done, stopping")
        return
    rank, workers = gt.ps.worker_rank(), gt.ps.worker_num()
    say = print if rank == 0 else (lambda *a, **k: None)
    num_ids = args.slots * args.vocab
    table = dict(optimizer=args.optimizer, lr=args.lr, geo_rows=args.geo_rows)
    if args.hashed:  # raw ids, any int64: rows made as ids are admitted, at most --hashed per server
        num_ids = None
        table.update(capacity=args.hashed, admit_count=args.admit_count)
    emb = gt.ps.EmbeddingTable(num_ids, args.dim, init_std=0.1, seed=1, name="embedding", **table)
    wide = gt.ps.EmbeddingTable(num_ids, 1, init_std=0.0, seed=2, name="wide", **table)
    model = WideAndDeep(emb, wide, args.slots, args.dim)
    dense_kind = "adagrad" if args.optimizer == "ftrl" else args.optimizer
    opt = gt.ps.DenseOptimizer(model.dense_parameters(), dense_kind, args.dense_lr)
    say(f"wide & deep, mode {args.mode}" + (f" (k_steps {args.k_steps})" if args.mode == "geo" else "")
        + f": {gt.ps.server_num()} servers, {workers} workers; tables {emb} and {wide}")

    def update(loss):
        opt.zero_grad()
        loss.backward()  # pushes the tables' row gradients
        opt.step()       # the dense parameters

    if args.checkpoint and args.mode == "async":
        raise SystemExit("--checkpoint: sync or geo mode (async keeps the dense layers on the servers)")
    first = resume(args, model, opt, say)
    rate = train(args, model, update, rank, workers, say, first, after_step_hook(args, model, opt, rank))
    print(f"worker {rank}: {rate:.0f} examples/s")
    if args.mode == "geo":
        # every worker's last changes reach the servers, then worker 0 takes them all:
        # it evaluates the servers' values, like the other modes (without the meeting,
        # whether another worker's last k steps counted depended on timing)
        for table in (emb, wide):
            table.flush()
        opt.flush()
        torch.distributed.barrier(group=gt.ps.worker_group())
    if rank == 0:
        if args.mode == "geo":
            for table in (emb, wide):
                table.flush()
            opt.flush()
        auc1, logloss = evaluate(args, model)
        say(f"held-out AUC {auc1:.4f}, log-loss {logloss:.4f}")
        if args.save:
            # (a hashed table has no row numbers to list: the dense parameters only)
            save(args.save, model, {} if args.hashed else {"embedding.weight": emb.weight(),
                                                           "wide.weight": wide.weight()})
        for name, t in (("embedding", emb), ("wide", wide)):
            say(f"table {name}: {t.stats()}")
    gt.ps.stop_worker()


if __name__ == "__main__":
    main()
