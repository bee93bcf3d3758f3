"""Cases ported from DTensor's own test suite that gave silently wrong values (or
raised) here. Each check names its DTensor source; values and gradients are compared
with plain torch on the whole tensors, in a world of 2 and a world of 4 processes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from mp import checks_in_worlds

import globaltensor as gt
from globaltensor.testing import no_fallback

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def _line():
    return gt.placement("cpu", list(range(gt.get_world_size())))


def _g(value, sbp, grad=False):
    x = gt.tensor(value, placement=_line(), sbp=sbp)
    return x.requires_grad_() if grad else x


def _close(got, want, what):
    got = got.full() if isinstance(got, gt.GlobalTensor) else got
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


def check_conj_of_split_complex():
    # DTensor test_dtensor_ops.py (OpInfo sweep: conj, conj_physical, resolve_conj).
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(6, 4, dtype=torch.complex64, generator=gen)
    for sbp in (S(0), S(1), B):
        x = _g(t, sbp)
        _close(x.conj() + 1, t.conj() + 1, f"conj() + 1 on {sbp}")
        _close(torch.conj_physical(x), torch.conj_physical(t), f"conj_physical on {sbp}")
        _close(x.conj().imag, t.conj().imag, f"conj().imag on {sbp}")
        _close(x.conj() * x, t.conj() * t, f"conj() * x on {sbp}")


def check_out_variant():
    # DTensor test_dtensor.py::test_op_out_variant: torch.add(x, 3, out=o), o in
    # the input's layout and in another one; the result is o itself.
    t = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    for out_sbp in (S(0), B, S(1)):
        x = _g(t, S(0))
        o = _g(torch.zeros(12, 3), out_sbp)
        res = torch.add(x, 3, out=o)
        assert res is o, "out= must return the out tensor"
        assert o.sbp == (out_sbp,), f"out= changed the layout to {o.sbp}"
        _close(o, t + 3, f"add out= {out_sbp}")
    a, b = _g(t, S(0)), _g(t * 2, S(1))
    o = _g(torch.zeros(12, 3), B)
    torch.mul(a, b, out=o)
    _close(o, t * t * 2, "mul out= with mixed input layouts")


def check_complex_rotary_gradients():
    # DTensor's tensor-parallel rotary embedding (torchtitan's apply_rotary_emb):
    # view_as_complex(xq) * freqs, view_as_real; gradients for xq.
    gen = torch.Generator().manual_seed(2)
    xq = torch.randn(2, 8, 4, 6, generator=gen)          # (batch, seq, heads, head_dim)
    angles = torch.randn(8, 3, generator=gen)
    freqs = torch.polar(torch.ones_like(angles), angles).view(1, 8, 1, 3)
    want_x = xq.clone().requires_grad_()
    ref = torch.view_as_real(torch.view_as_complex(want_x.reshape(2, 8, 4, 3, 2)) * freqs)
    ref = ref.flatten(3)
    ref.square().sum().backward()
    for sbp in (S(0), S(2), B):
        x = _g(xq, sbp, grad=True)
        f = _g(freqs, B)
        out = torch.view_as_real(torch.view_as_complex(x.reshape(2, 8, 4, 3, 2)) * f).flatten(3)
        _close(out, ref.detach(), f"rotary value on {sbp}")
        out.square().sum().backward()
        _close(x.grad, want_x.grad, f"rotary gradient of xq on {sbp}")


def check_copy_between_broadcastable_shapes():
    # DTensor test_tensor_ops.py::test_copy_: src (64, 1) into dst (4, 8, 64, 16),
    # specs that force a redistribute.
    src = torch.randn(64, 1, generator=torch.Generator().manual_seed(3))
    for src_sbp, dst_sbp in [(S(1), B), (S(1), S(0)), (S(1), S(1)), (S(0), S(2)), (S(0), S(3)),
                             (B, S(2))]:
        dst = _g(torch.zeros(4, 8, 64, 16), dst_sbp)
        dst.copy_(_g(src, src_sbp))
        assert dst.sbp == (dst_sbp,)
        _close(dst, src.expand(4, 8, 64, 16), f"copy_ {src_sbp} -> {dst_sbp}")
    vec = torch.randn(128, generator=torch.Generator().manual_seed(6))
    dst = _g(torch.zeros(128, 128), S(1))
    dst.copy_(_g(vec, S(0)))
    _close(dst, vec.expand(128, 128), "copy_ of a row into a column split")


def check_nll_loss_on_3d_inputs():
    # DTensor test_math_ops.py::test_nll_loss_and_cross_entropy: (N, C, d) logits
    # (nll_loss2d), batch, class and trailing dims split; values and gradients.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 6, 5, generator=gen)
    target = torch.randint(0, 6, (4, 5), generator=gen)
    target[0, 1] = -100
    weight = torch.rand(6, generator=gen)
    for reduction in ("mean", "sum", "none"):
        for w in (None, weight):
            want_x = logits.clone().requires_grad_()
            ref = F.cross_entropy(want_x, target, weight=w, reduction=reduction)
            ref.sum().backward()
            for x_sbp, t_sbp in [(S(0), S(0)), (S(1), B), (S(2), S(1)), (B, B)]:
                x = _g(logits, x_sbp, grad=True)
                gw = None if w is None else _g(w, B)
                what = f"cross_entropy {reduction} weight={w is not None} {x_sbp}"
                out = no_fallback(lambda: F.cross_entropy(x, _g(target, t_sbp), weight=gw,
                                                           reduction=reduction), what)
                _close(out, ref.detach(), what)
                no_fallback(lambda: out.sum().backward(), what + " backward")
                _close(x.grad, want_x.grad, what + " gradient")


def check_linear_under_inference_mode():
    # DTensor test_dtensor.py (inference_mode): F.linear arrives undecomposed; the
    # column-split weight must still give a split output.
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(3, 8, generator=gen), torch.randn(6, 8, generator=gen), \
        torch.randn(6, generator=gen)
    with torch.inference_mode():
        out = no_fallback(lambda: F.linear(_g(x, B), _g(w, S(0)), _g(b, S(0))), "linear")
        assert out.sbp == (S(1),), f"inference-mode linear gave {out.sbp}"
        _close(out, F.linear(x, w, b), "inference-mode linear")
        out = F.linear(_g(x, S(0)), _g(w, B))
        assert out.sbp == (S(0),)
        _close(out, F.linear(x, w), "inference-mode linear, batch split")


def check_views_under_inference_mode():
    """Views of global tensors made outside ``torch.inference_mode()`` (parameters,
    inputs), taken inside it: torch gives a view of a normal tensor its base's version
    counter, which a wrapper made inside (an inference tensor) could not take."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 6, 8, generator=gen)
    gx = _g(x, S(0))
    with torch.inference_mode():
        for what, f in (("transpose", lambda t: t.transpose(-2, -1)),
                        ("view", lambda t: t.view(4, 48)), ("split", lambda t: t.split(3, 2)[1]),
                        ("reshape of the split dim", lambda t: t.reshape(24, 8)),
                        ("a view of a view", lambda t: t.transpose(0, 1)[1])):
            _close(f(gx), f(x), f"inference-mode {what}")
        y = gx * 2   # made inside: an inference tensor, its views too
        _close(y.transpose(0, 2), (x * 2).transpose(0, 2), "inference-mode view of an inference tensor")


CHECKS = ["check_conj_of_split_complex", "check_out_variant", "check_complex_rotary_gradients",
          "check_copy_between_broadcastable_shapes", "check_nll_loss_on_3d_inputs",
          "check_linear_under_inference_mode", "check_views_under_inference_mode"]
test_world2, test_world4 = checks_in_worlds(__name__, CHECKS)
