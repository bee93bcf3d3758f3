"""Boxing speed: our ``to_global`` next to the raw collective that moves the same bytes
and next to DTensor's ``redistribute``, side by side in one run.

    python benchmarks/boxing.py                 # spawns 2 processes on this machine
    python benchmarks/boxing.py --numel 1048576 --plot boxing.png
    python -m globaltensor.launch --nproc_per_node 2 benchmarks/boxing.py
    python benchmarks/boxing.py --device cuda   # placements, raw peers, DTensor on GPUs

Prints the median time per call (ms) and the ratios ours/raw and DTensor/raw. The
cross-placement rows compare with raw send/recv of the same pieces (DTensor cannot
redistribute across meshes at all).

``--device cpu|cuda`` (default cpu): where the placements, DTensor's mesh and every
buffer of the raw and by-hand peers live (cuda: GPU ``LOCAL_RANK % device_count``); on
cuda each timed batch starts and ends with ``torch.cuda.synchronize()``. The raw peers
call torch.distributed in the default group, the one the library's collectives among
all ranks and its point-to-point transfers use: its cuda backend is NCCL when every
rank has a GPU of its own, else gloo (ranks sharing a GPU), and where gloo lacks a
collective on CUDA (all but broadcast and all_reduce) the library stages it through
host memory, and so do the raw peers (host buffers made once, the copies in and out
timed); the table says when.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _common import bar_plot, local_device, round_robin_median

from globaltensor.testing import spawn


def _dtensor_cases(n, shape, device):
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    except ImportError:
        return None
    mesh = init_device_mesh(device.type, (n,))
    rank = dist.get_rank()
    full = torch.randn(shape, device=device)
    part = full.chunk(n, 0)[rank].contiguous()

    def case(local, src, dst):
        d = DTensor.from_local(local, mesh, [src], run_check=False)
        return lambda: d.redistribute(mesh, [dst]).to_local()
    return {
        "S(0)->B": case(part, Shard(0), Replicate()),
        "P->B": case(full.clone(), Partial(), Replicate()),
        "P->S(0)": case(full.clone(), Partial(), Shard(0)),
        "S(0)->S(1)": case(part, Shard(0), Shard(1)),
    }


# Where a torch.distributed call is staged through host memory: the positional tensor
# arguments it reads ("i"), writes ("o") or both ("b").
_ROLES = {"all_gather": "oi", "all_reduce": "b", "reduce_scatter": "oi",
          "all_to_all": "oi", "send": "i", "recv": "o"}


def _torch_collectives(device: torch.device) -> tuple[dict, list]:
    """The raw peers' torch.distributed functions by kind, for ``device``'s tensors in the
    default group (``get_group`` of all ranks is ``group.WORLD``, and point-to-point
    transfers of the library use it too), and the kinds staged through host memory: a
    function itself where its backend runs it on ``device`` (cpu, NCCL), else, as the
    library's ``comm.collectives`` does where gloo serves cuda and lacks it there, the
    same call on host buffers (made once per shape) with the copies in and out."""
    fns = {"all_gather": dist.all_gather_into_tensor, "all_reduce": dist.all_reduce,
           "reduce_scatter": getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
           "all_to_all": dist.all_to_all_single,
           "send": dist.send, "recv": dist.recv}
    from globaltensor.comm import get_group
    assert get_group(tuple(range(dist.get_world_size()))) is dist.group.WORLD
    if device.type == "cpu":
        return fns, []
    from globaltensor.comm.groups import device_backend, stage_through_host
    backend = device_backend(device.type)
    staged = [k for k in fns if stage_through_host(k, device.type, backend)]
    return {k: _via_host(fn, _ROLES[k]) if k in staged else fn for k, fn in fns.items()}, staged


def _via_host(fn, roles: str):
    buffers: dict = {}

    def host(i: int, t: torch.Tensor) -> torch.Tensor:
        key = (i, tuple(t.shape), t.dtype)
        if key not in buffers:
            buffers[key] = torch.empty(t.shape, dtype=t.dtype)
        return buffers[key]

    def call(*args, **kwargs):
        args, back = list(args), []
        for i, role in enumerate(roles):
            t = args[i]
            args[i] = host(i, t)
            if role in "ib":
                args[i].copy_(t)
            if role in "ob":
                back.append((t, args[i]))
        result = fn(*args, **kwargs)
        for t, h in back:
            t.copy_(h)
        return result
    return call


def _runs(dtensor: dict) -> dict:
    """The DTensor cases every rank ran once without an error (the ranks agree); the
    others' reasons printed by rank 0 (e.g. a collective DTensor's backend lacks on
    this device)."""
    failed = torch.zeros(len(dtensor))
    why = {}
    for k, (name, fn) in enumerate(dtensor.items()):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (a case that cannot run is left out)
            failed[k] = 1
            why[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"
    dist.all_reduce(failed)
    for name in why if dist.get_rank() == 0 else ():
        print(f"DTensor {name}: n/a ({why[name]})")
    return {name: fn for k, (name, fn) in enumerate(dtensor.items()) if not failed[k]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--numel", type=int, default=4 * 1024 * 1024, help="elements (fp32)")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--plot", default=None, help="write a PNG bar chart here")
    args = ap.parse_args(argv)

    import globaltensor as gt
    device = local_device(args.device, gt.get_local_rank())
    gt.init()
    n, rank = gt.get_world_size(), gt.get_rank()
    coll, staged = _torch_collectives(device)
    all_gather_into_tensor, all_reduce = coll["all_gather"], coll["all_reduce"]
    reduce_scatter_tensor, all_to_all_single = coll["reduce_scatter"], coll["all_to_all"]
    cols = 512
    shape = (args.numel // cols, cols)
    p = gt.placement.all(args.device)
    S0, S1, B, P = gt.sbp.split(0), gt.sbp.split(1), gt.sbp.broadcast, gt.sbp.partial_sum
    x_s0 = gt.randn(*shape, placement=p, sbp=S0)
    x_p = gt.randn(*shape, placement=p, sbp=P)
    local = x_s0.to_local()
    full = torch.randn(shape, device=device)
    gathered = torch.empty(shape, device=device)
    scattered = torch.empty(local.shape, device=device)
    a2a_in = torch.randn(local.numel(), device=device)
    a2a_out = torch.empty(local.numel(), device=device)

    def hand_s0_s1():  # pack the column blocks, exchange, land in a fresh output
        packed = torch.cat([c.reshape(-1) for c in local.chunk(n, dim=1)])
        all_to_all_single(torch.empty(local.numel(), device=device), packed)

    a2a_full = torch.empty(full.numel(), device=device)
    reduce_me = full.clone()

    def hand_p_s0():  # all_to_all of the row blocks + local sum, on preallocated buffers
        all_to_all_single(a2a_full, full.view(-1))
        return a2a_full.view((n,) + tuple(local.shape)).sum(0)

    from globaltensor.tensor import to_layout
    b_layout = x_p.global_layout.with_sbp(B)
    x_p_donated = gt.from_local(full.clone(), placement=p, sbp=P)

    # name, ours, raw collective (same bytes), by hand (raw + the local work the
    # result needs: a fresh output that leaves the input intact, packing, the sum)
    rows = [
        ("S(0)->B", lambda: x_s0.to_global(sbp=B).to_local(),
         lambda: all_gather_into_tensor(gathered, local),
         lambda: all_gather_into_tensor(torch.empty(shape, device=device), local)),
        ("P->B", lambda: x_p.to_global(sbp=B).to_local(),
         lambda: all_reduce(full),
         lambda: all_reduce(full.clone())),
        # A temporary source (an op's intermediate result) is reduced in place.
        ("P->B donated", lambda: to_layout(x_p_donated, b_layout, donate=True),
         lambda: all_reduce(full), lambda: all_reduce(reduce_me)),
        ("P->S(0)", lambda: x_p.to_global(sbp=S0).to_local(),
         lambda: reduce_scatter_tensor(scattered, full), hand_p_s0),
        ("S(0)->S(1)", lambda: x_s0.to_global(sbp=S1).to_local(),
         lambda: all_to_all_single(a2a_out, a2a_in), hand_s0_s1),
    ]
    dtensor = _dtensor_cases(n, shape, device)
    if dtensor:
        dtensor = _runs(dtensor)

    # Cross-placement: half the ranks to the other half (DTensor cannot do these).
    if n >= 2:
        lo, hi = list(range(n // 2)), list(range(n // 2, n))
        src_p, dst_p = gt.placement(args.device, lo), gt.placement(args.device, hi)
        y = gt.randn(*shape, placement=src_p, sbp=S0)
        ylocal = y.to_local()
        peer_buf = torch.empty(gt.randn(*shape, placement=dst_p, sbp=S0).to_local().shape,
                               device=device)
        send, recv = coll["send"], coll["recv"]

        def raw_cross(fresh=False):
            if rank in lo:
                send(ylocal, hi[lo.index(rank)])
            else:
                recv(torch.empty_like(peer_buf) if fresh else peer_buf, lo[hi.index(rank)])
        rows.append(("S(0)@lo->S(0)@hi", lambda: y.to_global(placement=dst_p, sbp=S0).to_local(),
                     raw_cross, lambda: raw_cross(fresh=True)))

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    results = []
    for name, ours, raw, hand in rows:
        fns = [raw, hand, ours] + ([dtensor[name]] if dtensor and name in dtensor else [])
        t = [v * 1e3 for v in round_robin_median(fns, args.iters, sync=sync)] + [None]
        results.append((name, t[0], t[1], t[2], t[3]))

    if rank == 0:
        print(f"\n{n} processes, {args.numel} fp32 elements ({args.numel * 4 / 2**20:.0f} MiB), "
              f"median of {args.iters} (ms)"
              + (f"; on cuda ({dist.get_backend_config()}), batches end with "
                 f"cuda.synchronize" if sync else ""))
        head = (f"{'pair':<18}{'raw':>8}{'by hand':>9}{'ours':>8}{'DTensor':>9}"
                f"{'ours/raw':>10}{'ours/hand':>10}{'DT/raw':>8}")
        print(head)
        print("-" * len(head))
        for name, t_raw, t_hand, t_ours, t_dt in results:
            dt = f"{t_dt:9.2f}" if t_dt else f"{'n/a':>9}"
            dtr = f"{t_dt / t_raw:8.2f}" if t_dt else f"{'n/a':>8}"
            print(f"{name:<18}{t_raw:8.2f}{t_hand:9.2f}{t_ours:8.2f}{dt}"
                  f"{t_ours / t_raw:10.2f}{t_ours / t_hand:10.2f}{dtr}")
        print("raw: the bare collective on preallocated buffers; by hand: the same plus the "
              "local work a usable result needs (fresh output, input kept, packing, the "
              "local sum after an all_to_all for P->S(0)); 'P->B donated' reduces a "
              "temporary in place (by hand: an in-place all_reduce)")
        if staged:
            print(f"raw and by hand stage {', '.join(staged)} through host memory, as the "
                  f"library does: gloo carries cuda collectives here and lacks them on CUDA")
        if args.plot:
            bar_plot(args.plot, [r[0] for r in results],
                     {label: [r[k] for r in results]
                      for k, label in enumerate(["raw", "by hand", "ours", "DTensor"], 1)},
                     "median ms per call", "boxing: ours vs raw collective vs DTensor")
    dist.barrier()


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("boxing"):   # --write-docs: its table into docs/benchmarks.md
        spawn(main, 2)
