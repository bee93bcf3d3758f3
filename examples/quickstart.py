"""Quickstart: OneFlow's data-parallel and model-parallel matmul, on a "cpu" placement.

    python -m globaltensor.launch --nproc_per_node 4 examples/quickstart.py

Every rank runs this same program. A placement says which ranks hold a tensor, an sbp
says how: split(d) cuts dim d across them, broadcast gives each the whole tensor,
partial_sum gives each an addend. Ops pick how to compute from the sbps; to_global
redistributes. Each result is checked against the same computation on full values.
"""
import torch

import globaltensor as gt


def show(name, t):
    if gt.get_rank() == 0:
        print(f"{name:<28} shape={tuple(t.shape)!s:<9} sbp={t.sbp}")


def main():
    gt.manual_seed(0)
    P = gt.placement("cpu", ranks=list(range(gt.get_world_size())))

    # Data parallel: the batch is split, the weight is broadcast -> output split(0).
    x = gt.randn(4, 5, placement=P, sbp=gt.sbp.split(0))
    w = gt.randn(5, 8, placement=P, sbp=gt.sbp.broadcast)
    y = gt.matmul(x, w)
    show("data parallel x @ w", y)
    assert y.sbp == (gt.sbp.split(0),)
    torch.testing.assert_close(y.full(), x.full() @ w.full())

    # Model parallel: the input is broadcast, the weight split by columns -> split(1).
    x = gt.randn(4, 5, placement=P, sbp=gt.sbp.broadcast)
    w = gt.randn(5, 8, placement=P, sbp=gt.sbp.split(1))
    y = x @ w
    show("model parallel x @ w", y)
    assert y.sbp == (gt.sbp.split(1),)
    torch.testing.assert_close(y.full(), x.full() @ w.full())

    # Splitting the contracted dim gives partial sums; to_global reduces them.
    x = gt.randn(4, 6, placement=P, sbp=gt.sbp.split(1))
    w = gt.randn(6, 8, placement=P, sbp=gt.sbp.split(0))
    y = x @ w
    show("split contracted dim", y)
    assert y.sbp == (gt.sbp.partial_sum,)
    z = y.to_global(sbp=gt.sbp.broadcast)
    show("  .to_global(broadcast)", z)
    torch.testing.assert_close(z.to_local(), x.full() @ w.full())

    if gt.get_rank() == 0:
        print(f"all results equal the single-process values ({gt.get_world_size()} ranks)")


if __name__ == "__main__":
    main()
