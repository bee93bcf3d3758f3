"""Wide & deep CTR model with vocab-parallel embedding tables (parameter-server style).

    python -m globaltensor.launch --nproc_per_node 2 examples/wide_and_deep.py

The model of Paddle's parameter-server quick start (wide & deep on Criteo-like click
logs), written with global tensors on a "cpu" placement of all ranks:

- sparse categorical features (``--slots`` slots, ``--vocab`` ids each, one shared id
  space) look up two tables: a ``dim``-wide embedding for the deep part and a 1-wide
  weight per id for the wide part. Both tables are **split(0)**: each rank holds a
  block of rows (vocab-parallel embedding);
- the wide part sums the per-id weights and a linear layer of the dense features;
- the deep part is an MLP on the concatenated embeddings and dense features, data
  parallel (broadcast weights, batch split(0));
- logit = wide + deep; loss: binary cross-entropy with logits; Adam, synchronous.

How this maps to the parameter-server mode: the row shards of the tables play the
servers, and every rank is also a worker reading its own split(0) shard of the batch.

- send ids:  ``ids.to_global(sbp=broadcast)`` hands every table shard the batch's ids;
- lookup:    a shard looks up the ids it holds and writes zeros for the others, so the
             result is a **partial_sum**: its sum over the shards is the real lookup;
- pull:      ``to_global(sbp=split(0))`` sums the partials and leaves each worker the
             rows of its own samples (a reduce-scatter); the wide weights are summed
             over the slots first, while still partial, so only one number per sample
             is pulled for them;
- push:      backward sums the lookups' gradients into the table shards, each row's
             gradient landing on the rank that holds the row, and the optimizer
             updates every shard where it lives (synchronous training: every step sees
             every worker's gradients).

The click data is generated: a hidden per-id weight, dense coefficients and an
interaction between two slots give each sample a click probability, and labels are
drawn from it, so the model can learn. The example checks that the parallel forward
pass equals plain torch on full tables, that the training loss falls, and that the
held-out AUC and log-loss beat the trivial baseline (a constant click rate: AUC 0.5).
Options: ``--steps``, ``--batch``, ``--slots``, ``--vocab``, ``--dim``, ``--lr``.
"""
import argparse

import torch
import torch.nn.functional as F

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split
DENSE = 13  # Criteo's dense features


class WideAndDeep(torch.nn.Module):
    def __init__(self, num_ids, slots, dim, hidden=(64, 32)):
        super().__init__()
        self.embedding = torch.nn.Embedding(num_ids, dim)     # deep part's table
        self.wide_weight = torch.nn.Embedding(num_ids, 1)     # wide part: a weight per id
        torch.nn.init.normal_(self.embedding.weight, std=0.1)
        torch.nn.init.zeros_(self.wide_weight.weight)
        self.wide_dense = torch.nn.Linear(DENSE, 1)
        sizes = (slots * dim + DENSE,) + tuple(hidden)
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], 1))

    def forward(self, ids, dense):
        """ids (batch, slots), dense (batch, 13) -> logits (batch,)."""
        ids = send(ids, B)                                 # every shard sees all ids
        emb = self.embedding(ids)                          # partial_sum (batch, slots, dim)
        wide = self.wide_weight(ids).sum(dim=(1, 2))       # partial_sum (batch,)
        emb, wide = send(emb, S(0)), send(wide, S(0))      # pull: rows of my samples
        deep_in = torch.cat([emb.flatten(1), dense], dim=1)
        return wide + self.wide_dense(dense).squeeze(1) + self.mlp(deep_in).squeeze(1)


def send(x, sbp):
    """Redistribute a global tensor; plain tensors (the reference model) pass through."""
    return x.to_global(sbp=sbp) if gt.is_global(x) else x


def param_sbp(name, tensor):
    return S(0) if name in ("embedding.weight", "wide_weight.weight") else B


def make_data(n, slots, vocab, generator, truth):
    """n click-log samples: skewed ids per slot, dense features, labels ~ click prob."""
    u = torch.rand(n, slots, generator=generator)
    ids = (u * u * vocab).long() + torch.arange(slots) * vocab     # popular ids are small
    dense = torch.randn(n, DENSE, generator=generator)
    factors = truth["factors"]
    logit = (truth["id_weight"][ids].sum(1) + dense @ truth["dense_coef"]
             + 2.0 * (factors[ids[:, 0]] * factors[ids[:, 1]]).sum(1) - 1.0)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=generator)
    return ids, dense, labels, logit


def auc(scores, labels):
    """Area under the ROC curve (rank statistic; ties are negligible here)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--slots", type=int, default=8, help="sparse feature slots")
    parser.add_argument("--vocab", type=int, default=1000, help="ids per slot")
    parser.add_argument("--dim", type=int, default=8, help="embedding size")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--eval_size", type=int, default=4096)
    parser.add_argument("--log_every", type=int, default=10)
    args = parser.parse_args()

    world = gt.get_world_size()
    say = print if gt.get_rank() == 0 else (lambda *a, **k: None)
    P = gt.placement.all("cpu")
    num_ids = args.slots * args.vocab

    g = torch.Generator().manual_seed(0)   # the same data on every rank
    truth = {"id_weight": 0.6 * torch.randn(num_ids, generator=g),
             "dense_coef": 0.3 * torch.randn(DENSE, generator=g),
             "factors": torch.randn(num_ids, 4, generator=g) / 2}
    eval_ids, eval_dense, eval_labels, eval_true_logit = make_data(
        args.eval_size, args.slots, args.vocab, g, truth)

    torch.manual_seed(0)
    reference = WideAndDeep(num_ids, args.slots, args.dim)
    model = WideAndDeep(num_ids, args.slots, args.dim)
    model.load_state_dict(reference.state_dict())
    gt.nn.to_global(model, P, param_sbp)
    say(f"wide & deep: {args.slots} slots x {args.vocab} ids, tables split by rows "
        f"over {world} ranks")
    for name in ("embedding.weight", "wide_weight.weight", "mlp.0.weight"):
        p = dict(model.named_parameters())[name]
        say(f"  {name:<19} shape={tuple(p.shape)!s:<11} sbp={p.sbp}  "
            f"this rank's rows: {p.to_local().shape[0]}")

    def to_global(ids, dense, labels=None):
        # each worker keeps its split(0) shard of the batch (as if it read it from disk)
        out = [gt.tensor(ids, placement=P, sbp=S(0)), gt.tensor(dense, placement=P, sbp=S(0))]
        if labels is not None:
            out.append(gt.tensor(labels, placement=P, sbp=S(0)))
        return out

    def evaluate():
        with torch.no_grad():
            logits = model(*to_global(eval_ids, eval_dense)).full()
        loss = F.binary_cross_entropy_with_logits(logits, eval_labels).item()
        return auc(logits, eval_labels), loss

    # The global model computes what plain torch computes on the whole tables.
    with torch.no_grad():
        ids, dense = to_global(eval_ids[:64], eval_dense[:64])
        emb = model.embedding(send(ids, B))
        logits = model(ids, dense)
        expected = reference(eval_ids[:64], eval_dense[:64])
    if emb.sbp != (gt.sbp.partial_sum,) or logits.sbp != (S(0),):
        raise AssertionError(f"lookup is {emb.sbp}, logits {logits.sbp}")
    torch.testing.assert_close(logits.full(), expected, rtol=1e-5, atol=1e-5)
    say(f"  lookup sbp={emb.sbp}, logits sbp={logits.sbp}: equal plain torch's")

    rate = float(eval_labels.mean())
    base_loss = F.binary_cross_entropy_with_logits(
        torch.full_like(eval_labels, torch.logit(torch.tensor(rate)).item()), eval_labels).item()
    auc0, _ = evaluate()
    say(f"held-out set: {args.eval_size} samples, click rate {rate:.3f}; "
        f"baseline (constant rate) AUC 0.500 log-loss {base_loss:.4f}; "
        f"true click probabilities AUC {auc(eval_true_logit, eval_labels):.3f}")
    say(f"before training: AUC {auc0:.3f}")

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        ids, dense, labels, _ = make_data(args.batch, args.slots, args.vocab, g, truth)
        ids, dense, labels = to_global(ids, dense, labels)
        loss = F.binary_cross_entropy_with_logits(model(ids, dense), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.full().item())
        if step % args.log_every == 0 or step == args.steps - 1:
            say(f"step {step:4d}  loss {losses[-1]:.4f}")

    auc1, eval_loss = evaluate()
    say(f"after {args.steps} steps: held-out AUC {auc1:.3f} (baseline 0.500, before "
        f"{auc0:.3f}), log-loss {eval_loss:.4f} (baseline {base_loss:.4f})")
    k = max(1, min(10, args.steps // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    say(f"training loss: {first:.4f} -> {last:.4f} (mean of the first / last {k} steps)")
    for name, p in model.named_parameters():
        if p.grad.sbp != p.sbp:
            raise AssertionError(f"{name}.grad is {p.grad.sbp}, the parameter {p.sbp}")
    if not auc1 > 0.6 or not auc1 > auc0 + 0.05:
        raise AssertionError(f"held-out AUC {auc1:.3f} does not beat the baseline clearly")
    if not eval_loss < base_loss:
        raise AssertionError(f"held-out log-loss {eval_loss:.4f} >= baseline {base_loss:.4f}")
    if not last < first - 0.02:
        raise AssertionError(f"training loss did not decrease: {losses}")
    say("the model beats the constant-rate baseline on held-out clicks")


if __name__ == "__main__":
    main()
