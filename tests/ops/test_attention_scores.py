"""Attention written out with the sequence split (rules/attention_scores.py): ``q @
k.transpose(-2, -1)``, a scale, a mask, softmax and ``@ v`` as nanoGPT and Hugging Face
eager attention write them run as ring attention (no keys or values gathered, no
sequence x sequence scores), equal to one process forward and backward; any other use
of the scores computes them, with the program's values and gradients.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from check_helpers import S, _attention_equal, _close, _g, _gen, _line
from mp import checks_in_worlds

import globaltensor as gt

TOL = dict(atol=1e-5, rtol=1e-5)


def _nanogpt(q, k, v, keep):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(keep == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = F.dropout(att, 0.1, training=False)
    return att @ v


def _hugging_face(q, k, v, keep):
    mask = torch.zeros_like(keep).masked_fill(keep == 0, torch.finfo(torch.float32).min)
    att = torch.matmul(q, k.transpose(2, 3)) * k.shape[-1] ** -0.5
    att = mask + att   # (either order)
    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(att, v)


def _gpt2_eager(q, k, v, keep):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    mask_value = torch.full([], torch.finfo(att.dtype).min, dtype=att.dtype)
    att = torch.where(keep.bool(), att, mask_value)
    return F.softmax(att, dim=-1) @ v


def _bert(q, k, v, keep):
    padding = torch.zeros_like(keep[..., -1:, :])   # (1, 1, 1, keys): one row for all
    padding[..., -2:] = -10000.0                      # the last two keys are padding
    return F.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + padding, dim=-1) @ v


def _unmasked(q, k, v, keep):
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    return att.softmax(-1) @ v


def _three_dims(q, k, v, keep):
    b, h, t, d = q.shape
    att = torch.bmm(q.reshape(b * h, t, d), k.reshape(b * h, t, d).transpose(1, 2)) * 0.5
    out = torch.bmm(torch.softmax(att, -1), v.reshape(b * h, t, d))
    return out.reshape(b, h, t, d)


def _multi_query(q, k, v, keep):
    # one key and value head for every query head, broadcast by matmul (Falcon's eager
    # attention; grouped heads alike)
    return _hugging_face(q, k[:, :1], v[:, :1], keep)


FORMS = {"nanoGPT": _nanogpt, "Hugging Face eager": _hugging_face, "GPT-2 eager": _gpt2_eager,
         "BERT (a padding mask)": _bert, "unmasked": _unmasked, "3-D bmm": _three_dims,
         "multi-query": _multi_query}


def _against_one_process(form, shape, placement, sbp, what, ring=True, plain_mask=False):
    gen = _gen(7)
    q, k, v = (torch.randn(*shape, generator=gen) for _ in range(3))
    keep = torch.tril(torch.ones(shape[2], shape[2])).view(1, 1, shape[2], shape[2])
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = form(*want, keep)
    grad = torch.randn(ref.shape, generator=gen)
    ref.backward(grad)
    ins = [_g(t, sbp, grad=True, placement=placement) for t in (q, k, v)]
    gkeep = keep if plain_mask else gt.tensor(keep, placement=placement,
                                               sbp=(gt.sbp.broadcast,) * placement.ndim)
    with gt.debug.comm_stats() as stats:
        # a plain mask where plain operands are taken as broadcast (a converted module's
        # forward builds its masks so)
        with gt.implicit_broadcast() if plain_mask else contextlib.nullcontext():
            out = form(*ins, gkeep)
        out.backward(_g(grad, sbp, placement=placement))
    _attention_equal(stats, out, ref, ins, want, what, ring=ring, **TOL)


def check_written_out_attention_runs_as_the_ring():
    n = gt.get_world_size()
    for length in (4 * n, 4 * n + 3):   # even, and uneven parts
        for name, form in FORMS.items():
            _against_one_process(form, (2, 2, length, 8), _line(), S(2),
                                 f"{name}, length {length}")
        _against_one_process(_nanogpt, (2, 2, length, 8), _line(), S(2),
                             f"a plain mask, length {length}", plain_mask=True)


def check_written_out_attention_on_a_2d_placement():
    grid = gt.placement("cpu", [[0, 1], [2, 3]])
    for sbp in ((S(0), S(2)), (S(2), S(2))):
        for name in ("nanoGPT", "Hugging Face eager"):
            _against_one_process(FORMS[name], (2, 2, 10, 8), grid, sbp, f"2x2 {sbp} {name}")


def _weights_too(q, k, v, keep):
    att = F.softmax((q @ k.transpose(-2, -1)) * 0.3, dim=-1)
    return att @ v + att.mean(-1, keepdim=True)   # the weights used beyond attention


def check_other_uses_compute_the_scores():
    length = 3 * gt.get_world_size() + 1
    shape, p = (1, 2, length, 4), _line()
    _against_one_process(_weights_too, shape, p, S(2), "the weights used too", ring=False)
    q, k, v = (_g(torch.randn(*shape, generator=_gen(i)), S(2), placement=p) for i in (1, 2, 3))
    att = q @ k.transpose(-2, -1)
    assert type(att).__name__ == "AttentionScores" and isinstance(att, gt.GlobalTensor)
    assert att.shape == (1, 2, length, length) and att.sbp == (S(2),)
    want = q.full() @ k.full().transpose(-2, -1)
    _close(att.full(), want, "the scores", **TOL)
    assert att.to_local().shape[2] == q.to_local().shape[2]   # this rank's queries
    _close(att.sum(), want.sum(), "a reduction of the scores", **TOL)
    assert "AttentionScores" not in repr(att) and "GlobalTensor" in repr(att)
    # dropout that drops: computed as written (keys gathered, or the gather an op
    # before made of them reused: boxing/reuse.py), its draws its own
    with gt.debug.comm_stats() as stats, gt.testing.boxing_log() as log:
        out = F.dropout(F.softmax(att, dim=-1), 0.5, training=True) @ v
    gathered = stats.calls["all_gather"] > 0 or any("reuses the boxing" in m for m in log)
    assert gathered and out.shape == v.shape, (stats, log)
    # in place: noted as the same steps, or refused where the scores cannot follow
    future = torch.ones(length, length).triu(1).bool()
    att = q @ k.transpose(-2, -1)
    att *= 0.5
    att.masked_fill_(_g(future, gt.sbp.broadcast, placement=p), float("-inf"))
    assert type(att).__name__ == "AttentionScores" and len(att.steps) == 2
    _close(att.softmax(-1) @ v, torch.softmax((want * 0.5).masked_fill(future, float("-inf")),
                                              -1) @ v.full(), "in-place steps", **TOL)
    try:
        (q @ k.transpose(-2, -1)).exp_()
    except RuntimeError as e:
        assert "out of place" in str(e), e
    else:
        raise AssertionError("an in-place op the scores cannot note ran")
    # other products of a row split by a column split keep their own rule
    wide = _g(torch.randn(1, 2, 4, length + 1, generator=_gen(4)), S(3), placement=p)
    assert type(q @ wide).__name__ == "GlobalTensor"


class _Block(torch.nn.Module):
    def __init__(self, vocab=16, dim=8, length=12):
        super().__init__()
        self.emb, self.qkv = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("bias", torch.tril(torch.ones(length, length)).view(
            1, 1, length, length))

    def forward(self, ids):
        x = self.emb(ids)
        b, t, c = x.shape
        q, k, v = (y.view(b, t, 2, c // 2).transpose(1, 2) for y in self.qkv(x).split(c, 2))
        y = _nanogpt(q, k, v, self.bias[:, :, :t, :t]).transpose(1, 2).reshape(b, t, c)
        return self.head(x + y)


def check_a_model_with_written_out_attention_trains_equal():
    """Several steps (whole-step planning records and replays them): the losses and
    parameters of one process."""
    torch.manual_seed(0)
    plain = _Block()
    model = gt.nn.to_global(_Block(), _line(), gt.sbp.broadcast)
    model.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 16, (2, 12), generator=_gen(5))
    gids = gt.tensor(ids, placement=_line(), sbp=S(1))   # the sequence split
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, model)]
    for step in range(8):
        losses = []
        for m, x, opt in zip((plain, model), (ids, gids), opts):
            loss = F.cross_entropy(m(x).flatten(0, 1), (x + 1).flatten() % 16)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-5, (step, losses)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        _close(b, a.detach(), name, **TOL)


def check_checkpointed_attention_recomputes_as_its_forward():
    """Attention written out inside ``torch.utils.checkpoint`` (non-reentrant and
    reentrant): the recompute in backward runs the ring as the forward did (computing the
    scores there instead saved other tensors: torch's CheckpointError)."""
    from torch.utils.checkpoint import checkpoint
    for reentrant in (False, True):
        def form(q, k, v, keep, reentrant=reentrant):
            return checkpoint(_hugging_face, q, k, v, keep, use_reentrant=reentrant)
        _against_one_process(form, (2, 2, 4 * gt.get_world_size(), 8), _line(), S(2),
                             f"checkpointed, use_reentrant={reentrant}")


CHECKS = ["check_written_out_attention_runs_as_the_ring",
          "check_other_uses_compute_the_scores",
          "check_a_model_with_written_out_attention_trains_equal",
          "check_checkpointed_attention_recomputes_as_its_forward"]
test_world2, test_world4 = checks_in_worlds(
    __name__, CHECKS, only_in_4=["check_written_out_attention_on_a_2d_placement"])


def test_written_out_attention_simulates_at_scale():
    """``gt.debug.simulate_step`` of a model with attention written out, its tokens split
    on the sequence over 8 ranks: the deferred scores run on fake parts (no memory)."""
    def make():
        P = gt.placement.all("cpu")
        model = gt.nn.to_global(_Block(length=64), P, gt.sbp.broadcast)
        ids = gt.randint(0, 16, (2, 64), placement=P, sbp=S(1))

        def step():
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        return step
    report = gt.debug.simulate_step(make, placement=gt.placement("cpu", ranks=range(8)),
                                    device="h100")
    assert report.step_seconds > 0 and report.bytes > 0, report
