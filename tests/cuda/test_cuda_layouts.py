"""The sequence split and the expert split on cuda placements equal one plain process:
attention of q, k, v split on the sequence (in half precision on the flash kernel, CUDA's
on a GPU, as ring attention: nothing gathered; the other fused kernels move them to a
head split or gather them),
``gt.nn.packed_attention`` (its ring's blocks as plain ops off the CPU), and
``gt.nn.MoE`` with its experts split, forward and backward."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from cuda_suite import local_device, place, seeded, world_checks

import globaltensor as gt

S = gt.sbp.split
TOL = dict(rtol=1e-4, atol=1e-5)


def _close(got, want, what):
    torch.testing.assert_close(got.full().detach().cpu(), want.detach().cpu(), **TOL,
                               msg=lambda m: f"{what}: {m}")


def check_sequence_split_attention():
    n = gt.get_world_size()
    P, g = place(list(range(n))), seeded(48)
    q, k, v = (torch.randn(2, 4, 8 * n + 3, 16, generator=g) for _ in range(3))
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*want, is_causal=True)
    ref.square().sum().backward()
    ins = [gt.tensor(t, placement=P, sbp=S(2)).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ins, is_causal=True)
    out.square().sum().backward()
    assert out.to_local().device == local_device() or out.to_local().numel() == 0
    _close(out, ref, "sequence split attention")
    for name, x, w in zip("qkv", ins, want):
        _close(x.grad, w.grad, f"sequence split attention: gradient of {name}")
    ins = [gt.tensor(t, placement=P, sbp=S(2)).requires_grad_() for t in (q, k, v)]
    offsets = [0, 5, 8 * n, 8 * n + 3]
    packed = gt.nn.packed_attention(*ins, offsets)
    packed.square().sum().backward()
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = gt.nn.packed_attention(*plain, offsets)
    ref.square().sum().backward()
    _close(packed, ref, "packed attention")
    _close(ins[1].grad, plain[1].grad, "packed attention: gradient of k")


def check_sequence_split_attention_on_the_flash_kernel():
    """bf16 q, k, v split on the sequence through the flash kernel (CUDA's on a GPU,
    each ring block on it) go round the ring, neither gathered nor moved to a head
    split, and equal the kernel on the whole tensors in one process."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    n = gt.get_world_size()
    P, g = place(list(range(n))), seeded(49)
    q, k, v, grad = (torch.randn(2, 4, 64 * n + 8, 64, generator=g).to(torch.bfloat16)
                     for _ in range(4))
    want = [t.to(local_device()).requires_grad_() for t in (q, k, v)]
    tol = dict(rtol=2e-2, atol=2e-2)   # the ring merges blocks in fp32, the kernel does not
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(*want, is_causal=True)
        ref.backward(grad.to(local_device()))
        ins = [gt.tensor(t, placement=P, sbp=S(2)).requires_grad_() for t in (q, k, v)]
        with gt.debug.comm_stats() as stats:
            out = F.scaled_dot_product_attention(*ins, is_causal=True)
            out.backward(gt.tensor(grad, placement=P, sbp=S(2)))
    assert stats.calls["all_gather"] == stats.calls["all_to_all"] == 0, stats
    assert out.sbp == (S(2),), out.sbp
    torch.testing.assert_close(out.full().float().cpu(), ref.detach().float().cpu(), **tol)
    for name, x, w in zip("qkv", ins, want):
        torch.testing.assert_close(x.grad.full().float().cpu(), w.grad.float().cpu(), **tol,
                                   msg=lambda m: f"gradient of {name}: {m}")


def check_experts_split():
    n = gt.get_world_size()
    P = place(list(range(n)))
    torch.manual_seed(0)
    plain = gt.nn.MoE(16, 32, experts=2 * n, top_k=2, capacity_factor=0.75)
    layer = gt.nn.to_global(__import__("copy").deepcopy(plain), P,
                            gt.nn.MoE.expert_sbp(plain))
    x = torch.randn(6 * n, 16, generator=seeded(3))
    want = plain(x.clone().requires_grad_())
    (want.square().sum() + plain.aux_loss).backward()
    got = layer(gt.tensor(x, placement=P, sbp=S(0)))
    (got.square().sum() + layer.aux_loss).backward()
    assert layer.last_dropped == plain.last_dropped > 0
    _close(got, want, "MoE output")
    for (name, p), q in zip(layer.named_parameters(), plain.parameters()):
        _close(p.grad, q.grad, f"MoE gradient of {name}")


test_layouts_world2 = world_checks(__name__, 2, [
    "check_sequence_split_attention", "check_sequence_split_attention_on_the_flash_kernel",
    "check_experts_split"])
