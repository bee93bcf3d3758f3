"""Long sequences and mixtures of experts as layouts, against one process: a training
step of ``examples/long_context.py``'s GPT with its sequence split (ring attention), and
of ``examples/moe.py``'s MoE GPT with its experts split, side by side with the same
step on one process's whole tensors; the sequence split also in zig-zag order
(``gt.nn.zigzag_order``: a balanced causal ring).

    python benchmarks/long_context.py                  # 2 processes, sequences 2048 and 8192
    python benchmarks/long_context.py --nproc 4 --seqs 2048,8192
    python benchmarks/long_context.py --written-out 4096,8192   # attention written out

Each round times every row on every rank in a shuffled order (the one-process rows run
on each rank alone, one thread each, as the split rows do); medians of the slowest
rank. "kept MiB": what one forward keeps for backward on a rank (each storage once),
the memory that grows with the sequence. "attention written out": ``q @ k.transpose(-2,
-1)``, scale, causal ``masked_fill``, softmax, ``@ v`` on q, k, v of (1, 8, sequence, 64)
split on the sequence, forward and backward, as deferred scores run it (the ring) and
with the scores computed as written (keys gathered: the version before); "per rank" is
then the peak resident rise (MiB) of one call. DTensor's context parallel
(``torch.distributed.tensor.experimental.context_parallel``) patches only the CUDA
attention kernels, so it has no row on CPU.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from _common import example_module, round_robin_median

from globaltensor.planner.record import RECORD_AT
from globaltensor.testing import spawn

WARMUP = RECORD_AT + 1   # steps before timing: past the one whole-step planning records


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seqs", default="2048,8192", help="sequence lengths of the GPT rows")
    ap.add_argument("--written-out", default="2048,4096",
                    help="sequence lengths of the attention-written-out rows")
    ap.add_argument("--moe-tokens", type=int, default=4096, help="tokens per rank, MoE rows")
    ap.add_argument("--iters", type=int, default=7)
    return ap


def _gpt_rows(seq: int, P, iters: int) -> tuple:
    """(one process's, in order's, zig-zag order's step; what one process and a rank
    in order keep for backward)."""
    import globaltensor as gt
    ex = example_module("long_context")
    torch.manual_seed(0)
    plain = ex.GPT(seq)
    split, zigzag = (gt.nn.to_global(copy.deepcopy(plain), P, gt.sbp.broadcast)
                     for _ in range(2))
    zigzag.order = gt.nn.zigzag_order(seq, P.size)
    batch = ex.batch(seq, 0)

    def step(model, placement=None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        taken = ex.laid_out(model, *batch, placement)

        def run():
            ex.loss_of(model, *taken).backward()
            opt.step()
            opt.zero_grad()
        return run
    times = round_robin_median([step(plain), step(split, P), step(zigzag, P)], iters,
                               warmup=WARMUP)
    return times, (ex.kept_for_backward(plain, seq), ex.kept_for_backward(split, seq, P))


def _attention(q, k, v, keep):
    """Attention as nanoGPT writes it without flash (rules/attention_scores.py)."""
    import math

    import torch.nn.functional as F
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(keep == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def _written_out_rows(seq: int, P, iters: int) -> tuple:
    """Attention written out, forward and backward of (1, 8 heads, seq, 64): (one
    process's, the split's (deferred: the ring), the split's with its scores computed
    as written (keys gathered) seconds; peak resident rise in MiB of the two splits)."""
    import globaltensor as gt
    from globaltensor.rules.attention_scores import _computed
    from globaltensor.testing import peak_rise
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, 8, seq, 64, generator=gen).requires_grad_() for _ in range(3)]
    keep = torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq)
    parts = [gt.tensor(t.detach(), placement=P, sbp=gt.sbp.split(2)).requires_grad_()
             for t in whole]
    gkeep = gt.tensor(keep, placement=P, sbp=gt.sbp.broadcast)

    def one():
        _attention(*whole, keep).sum().backward()

    def split():
        _attention(*parts, gkeep).sum().backward()

    def computed():
        with _computed():
            split()
    times = round_robin_median([one, split, computed], iters, warmup=1)
    peaks = []
    for fn in (split, computed):
        with peak_rise() as peak:
            fn()
        peaks.append(peak.mib)
    return times, peaks


def _moe_rows(tokens: int, P, iters: int) -> tuple:
    import torch.nn.functional as F

    import globaltensor as gt
    ex = example_module("moe")
    n = P.size
    torch.manual_seed(0)
    plain = ex.GPT()
    split = gt.nn.to_global(copy.deepcopy(plain), P, gt.nn.MoE.expert_sbp(plain))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, split)]
    rows = max(n, tokens * n // ex.SEQ)
    ids = torch.randint(0, ex.VOCAB, (rows, ex.SEQ + 1), generator=torch.Generator().manual_seed(1))
    whole = (ids[:, :-1], ids[:, 1:])
    parts = tuple(gt.tensor(t, placement=P, sbp=gt.sbp.split(0)) for t in whole)
    mine = tuple(t.tensor_split(n)[gt.get_rank()] for t in whole)   # one rank's share

    def step(model, opt, batch):
        def run():
            x, y = batch
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) + ex.AUX * model.aux_loss()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return run
    return round_robin_median([step(plain, opts[0], whole), step(split, opts[1], parts),
                               step(plain, opts[0], mine)], iters, warmup=WARMUP), rows * ex.SEQ


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    import globaltensor as gt
    gt.init()
    torch.set_num_threads(1)
    n, P = gt.get_world_size(), gt.placement.all("cpu")
    lines = [f"{n} processes, one thread each; ms per training step (AdamW), medians of "
             f"{args.iters} rounds, slowest rank",
             f"{'row':<34}{'one process':>12}{'split':>9}{'ratio':>7}{'kept MiB 1':>11}"
             f"{'per rank':>9}", "-" * 82]
    for seq in (int(s) for s in args.seqs.split(",")):
        (one, split, zigzag), (kept_one, kept) = _gpt_rows(seq, P, args.iters)
        lines.append(f"{f'GPT sequence {seq}, split on {n} ranks':<34}{one * 1e3:>12.1f}"
                     f"{split * 1e3:>9.1f}{split / one:>7.2f}{kept_one / 2**20:>11.2f}"
                     f"{kept / 2**20:>9.2f}")
        lines.append(f"{'  the same in zig-zag order':<34}{'':>12}{zigzag * 1e3:>9.1f}"
                     f"{zigzag / one:>7.2f}")
    for seq in (int(s) for s in args.written_out.split(",") if s):
        (one, split, computed), (peak, peak_computed) = _written_out_rows(seq, P, args.iters)
        lines.append(f"{f'attention written out, sequence {seq}':<34}{one * 1e3:>12.1f}"
                     f"{split * 1e3:>9.1f}{split / one:>7.2f}{'':>11}{peak:>9.1f}")
        lines.append(f"{'  its scores computed as written':<34}{'':>12}{computed * 1e3:>9.1f}"
                     f"{computed / one:>7.2f}{'':>11}{peak_computed:>9.1f}")
    (whole, split, share), tokens = _moe_rows(args.moe_tokens, P, args.iters)
    lines.append(f"{f'MoE GPT {tokens} tokens, experts split':<34}{whole * 1e3:>12.1f}"
                 f"{split * 1e3:>9.1f}{split / whole:>7.2f}")
    lines.append(f"{'  (one process, 1/n of the tokens)':<34}{share * 1e3:>12.1f}")
    if gt.get_rank() == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    from _docs import docs_section
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with docs_section("long_context"):   # --write-docs: its table into docs/benchmarks.md
        spawn(main, _parser().parse_args().nproc)
