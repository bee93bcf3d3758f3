"""A Llama-style decoder trained on a 2x2 placement, four ways, each against one plain
process: the program a new user writes from the README.

    python -m globaltensor.launch --nproc_per_node 4 examples/llama_2d.py

The model has what Llama has: RMSNorm, SwiGLU, rotary tables built in the forward from
``torch.arange``, grouped-query attention (4 query heads share 2 key/value heads) and
``F.scaled_dot_product_attention``. It trains with AdamW, a cosine schedule and gradient
clipping. On ``[[0, 1], [2, 3]]`` (axis 0: data, axis 1: tensor):

1. ``megatron``: data x tensor parallel: the batch split on axis 0; q/k/v and the
   SwiGLU's w1/w3 column-split, wo and w2 row-split on axis 1 (Megatron's layout);
2. ``fully_shard``: ZeRO-3 over the placement (``gt.nn.fully_shard``);
3. ``auto``: ``gt.nn.auto_parallel`` chooses among data, tensor and fully sharded
   layouts and their 2-D hybrids by timing them;
4. ``compiled``: the Megatron layout with the whole train step under ``torch.compile``
   (``loss.backward()``, ``opt.step()`` and ``opt.zero_grad()`` inside).

Each part checks every step's loss and the final parameters against the plain model;
any mismatch raises on every rank. Options: ``--parts`` (comma-separated), ``--steps``.
With 2 processes the placement is ``[[0], [1]]`` (data only) and the same checks run.
"""
from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split


@dataclass
class LlamaConfig:
    """The model's sizes (this example's: a small Llama; ``benchmarks/simulate.py``
    simulates a large one)."""
    dim: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 64
    vocab: int = 64
    layers: int = 2


VOCAB, BATCH, SEQ = LlamaConfig.vocab, 8, 16


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(seq: int, head_dim: int, device) -> tuple:
    """cos and sin tables, (seq, head_dim), built as Llama builds them."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class Attention(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = torch.nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = torch.nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = torch.nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        cos, sin = rotary(t, self.head_dim, x.device)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        repeat = q.shape[2] // k.shape[2]        # grouped-query attention, as Llama
        k = k[:, :, :, None, :].expand(b, t, k.shape[2], repeat, self.head_dim)
        v = v[:, :, :, None, :].expand(b, t, v.shape[2], repeat, self.head_dim)
        k = k.reshape(b, t, -1, self.head_dim)
        v = v.reshape(b, t, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = torch.nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = torch.nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = torch.nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(cfg.dim), Attention(cfg)
        self.ffn_norm, self.feed_forward = RMSNorm(cfg.dim), FeedForward(cfg)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = torch.nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


COLUMN = ("wq", "wk", "wv", "w1", "w3")   # Megatron: split the output features
ROW = ("wo", "w2")                        # and the input features of the layer after


def megatron(name: str, t) -> tuple:
    """Broadcast on the data axis; Megatron's column/row split on the tensor axis."""
    module = name.rsplit(".", 2)[-2] if "." in name else ""
    if module in COLUMN:
        return (B, S(0))
    if module in ROW:
        return (B, S(1))
    return (B, B)


def say(*args) -> None:
    if gt.get_rank() == 0:
        print(*args, flush=True)


def optimizer_of(model, steps: int, compiled: bool = False):
    # Compiled, the learning rate is a tensor (torch's advice for compiled optimizers
    # with a schedule: a float lr is a constant of the graph, recompiled at every step).
    lr = torch.tensor(3e-3) if compiled else 3e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    return opt, sched


def batches(steps: int):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        yield ids[:, :-1], ids[:, 1:]


def plain_run(model, steps: int) -> list:
    opt, sched = optimizer_of(model, steps)
    losses = []
    for x, y in batches(steps):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def global_run(model, P, steps: int, compiled: bool = False) -> list:
    opt, sched = optimizer_of(model, steps, compiled)
    batch_sbp = (S(0),) + (B,) * (P.ndim - 1)

    def train_step(x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    step = torch.compile(train_step) if compiled else train_step
    losses = []
    for x, y in batches(steps):
        x = gt.tensor(x, placement=P, sbp=batch_sbp)
        y = gt.tensor(y, placement=P, sbp=batch_sbp)
        losses.append(step(x, y).item())
        sched.step()
    return losses


def check(part: str, losses: list, want: list, model, plain) -> None:
    """Raise on every rank unless the losses and final parameters match."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4,
                               atol=1e-5, msg=lambda m: f"{part}: losses differ: {m}")
    whole = gt.nn.full_state_dict(model, ranks=range(gt.get_world_size()))
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(whole[name], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{part}: {name} differs: {m}")
    say(f"  {part}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"equal to one process")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="megatron,fully_shard,auto,compiled")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    world = gt.get_world_size()
    if world not in (2, 4):
        raise SystemExit("run with --nproc_per_node 4 (2x2) or 2 (2x1)")
    P = gt.placement("cpu", [[0, 1], [2, 3]] if world == 4 else [[0], [1]])
    torch.manual_seed(0)
    initial = Llama()
    plain = copy.deepcopy(initial)
    want = plain_run(plain, args.steps)
    say(f"Llama ({sum(p.numel() for p in initial.parameters())} parameters) on "
        f"{P.ranks}, {args.steps} steps, against one process:")
    for part in args.parts.split(","):
        model = copy.deepcopy(initial)
        if part in ("megatron", "compiled"):
            gt.nn.to_global(model, P, megatron)
        elif part == "fully_shard":
            gt.nn.fully_shard(model, P)
        elif part == "auto":
            x, y = next(batches(1))
            probe = copy.deepcopy(initial)
            plan = gt.nn.auto_parallel(
                probe, P, (gt.tensor(x, placement=P, sbp=(S(0), B)),),
                loss_fn=lambda logits: F.cross_entropy(logits.flatten(0, 1),
                                                       gt.tensor(y, placement=P,
                                                                 sbp=(S(0), B)).flatten()))
            say(f"  auto_parallel chose {plan.strategy}")
            plan.apply(model)
        else:
            raise SystemExit(f"unknown part {part!r}")
        check(part, global_run(model, P, args.steps, compiled=part == "compiled"), want,
              model, plain)


if __name__ == "__main__":
    main()
