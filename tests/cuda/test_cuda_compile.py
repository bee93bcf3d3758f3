"""``torch.compile`` of a global GPT-style module on cuda placements: nanoGPT in
miniature, its positions built in forward with ``torch.arange(T, device=idx.device)``
and no context manager, compiled whole (``fullgraph=True``, inductor) trains like eager
(and like plain torch) at world 1 and data parallel on 2 ranks, as every traced
same-placement boxing (its functional collectives on the GPUs) equals eager; and with
``mode="reduce-overhead"`` (CUDA graphs) at world 1, where the graphs must really be
recorded (no "skipping cudagraphs"; in a dry run on cpu placements inductor has no
CUDA graphs to make, and only the values are checked)."""
from __future__ import annotations

import copy
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from cuda_suite import ON_CUDA, local_device, place, seeded, world_checks

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
VOCAB, LENGTH, WIDTH, HEADS, STEPS = 16, 6, 8, 2, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.c_fc, self.mlp_proj = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token and position embeddings, two pre-norm blocks, final norm, a head tied to
    the token embedding; returns the loss."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)   # a plain tensor: broadcast
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def _batches(rows=4):
    g = seeded(3)
    return [(torch.randint(0, VOCAB, (rows, LENGTH), generator=g),
             torch.randint(0, VOCAB, (rows, LENGTH), generator=g)) for _ in range(STEPS)]


def _train(model, batches, wrap, before_step=lambda: None):
    """SGD steps of ``model`` on ``batches`` (made global by ``wrap``): the losses (read
    at once: CUDA graphs reuse their output memory) and the final parameters. Not Adam:
    the key bias's gradient is zero but for rounding (softmax ignores a constant added
    to a row of scores), which Adam's normalisation would turn into whole steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for idx, targets in batches:
        before_step()
        loss = model(wrap(idx), wrap(targets))
        losses.append(loss.full().detach().clone() if gt.is_global(loss) else loss.detach().clone())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, [p.detach() for p in model.parameters()]


def _compiled_trains_like_eager(placement, data_sbp, **compile_kwargs):
    dev = local_device()
    torch.manual_seed(0)
    plain = GPT().to(dev)
    eager = gt.nn.to_global(copy.deepcopy(plain), placement, B)
    compiled = gt.nn.to_global(copy.deepcopy(plain), placement, B)
    batches = _batches()
    wrap = lambda t: gt.tensor(t, placement=placement, sbp=data_sbp)   # noqa: E731
    torch._dynamo.reset()
    # compiled whole: the plain arange must not break the graph
    compiled.forward = torch.compile(compiled.forward, fullgraph=True, **compile_kwargs)
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    want, want_params = _train(plain, batches, lambda t: t.to(dev))
    ref, ref_params = _train(eager, batches, wrap)
    got, got_params = _train(compiled, batches, wrap, before_step=mark)
    for step, (a, b, c) in enumerate(zip(want, ref, got)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"eager, step {step}: {m}")
        torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"compiled, step {step}: {m}")
    names = [n for n, _ in plain.named_parameters()]
    for name, a, b, c in zip(names, want_params, ref_params, got_params):
        assert b.sbp == c.sbp == (B,) and c.to_local().device == dev, (name, c.sbp)
        torch.testing.assert_close(b.full(), a, rtol=1e-4, atol=1e-5, msg=lambda m: f"eager {name}: {m}")
        torch.testing.assert_close(c.full(), b.full(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"compiled {name}: {m}")


def check_compiled_gpt_trains_like_eager_world1():
    _compiled_trains_like_eager(place([0]), B)


def check_traced_boxing_equals_eager():
    # every same-placement sbp change on 2 ranks (uneven parts), compiled whole: the
    # graph holds functional collectives (all_gather, all_reduce, all_to_all) on the
    # parts, which run on the ranks' GPUs
    P = place([0, 1])
    kinds = [S(0), S(1), B, gt.sbp.partial_sum]
    value = torch.randn(5, 3, generator=seeded(4))
    for src in kinds:
        torch._dynamo.reset()
        f = torch.compile(lambda x: [x.to_global(sbp=dst) * 2 for dst in kinds],
                          backend="aot_eager", fullgraph=True)
        for dst, y in zip(kinds, f(gt.tensor(value, placement=P, sbp=src))):
            assert y.sbp == (dst,) and y.to_local().device == local_device(), (src, dst)
            torch.testing.assert_close(y.full().cpu(), value * 2,
                                       msg=lambda m: f"{src} -> {dst}: {m}")
    torch._dynamo.reset()


def check_compiled_gpt_trains_like_eager_data_parallel():
    _compiled_trains_like_eager(place([0, 1]), S(0))


class _Skips(logging.Handler):
    """The reasons inductor gives for not making CUDA graphs ("skipping cudagraphs due
    to ...")."""

    def __init__(self):
        super().__init__()
        self.reasons: list = []

    def emit(self, record):
        text = record.getMessage()
        if "cudagraph" in text and "skip" in text:
            self.reasons.append(text)


def check_reduce_overhead_cuda_graphs_world1():
    from torch._dynamo.utils import counters
    counters.clear()
    skips = _Skips()
    log = logging.getLogger("torch._inductor")
    log.addHandler(skips)
    try:
        _compiled_trains_like_eager(place([0]), B, mode="reduce-overhead")
    finally:
        log.removeHandler(skips)
    if ON_CUDA:     # the graphs were made and replayed, not skipped
        skipped = counters["inductor"]["cudagraph_skips"]
        assert not skipped and not skips.reasons, \
            f"inductor skipped CUDA graphs {skipped} time(s): {skips.reasons}"
        from torch._inductor import cudagraph_trees
        manager = cudagraph_trees.get_manager(local_device().index or 0, False)
        assert manager is not None, "no CUDA graph tree was made"
        assert getattr(manager, "roots", True), "no CUDA graph was recorded"
    torch._dynamo.reset()


test_compile_world1 = world_checks(
    __name__, 1, ["check_compiled_gpt_trains_like_eager_world1",
                  "check_reduce_overhead_cuda_graphs_world1"])
test_compile_world2 = world_checks(
    __name__, 2, ["check_traced_boxing_equals_eager",
                  "check_compiled_gpt_trains_like_eager_data_parallel"])
