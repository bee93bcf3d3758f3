"""Which backend carries cuda collectives, on a machine with any number of GPUs.

gloo carries cpu tensors; cuda tensors go through NCCL only when every rank with a GPU
has one of its own (NCCL refuses two ranks on one GPU: "Duplicate GPU detected"), else
through gloo with one warning, and what gloo lacks on CUDA runs on host copies. Nothing
binds the default group to a GPU (``device_id``), so a program on cpu placements never
starts NCCL. These run without a GPU: the choice is pure functions and a store meeting
(ranks as threads here), the worlds stand in for the GPUs (``torch.cuda`` patched in
the workers), and the host-copy path runs on cpu tensors, the same code as on cuda.
"""
from __future__ import annotations

import datetime
import threading

import pytest
from mp import World

# --------------------------------------------------------------------------------------
# pure choices
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("local_rank, count, visible, gpu", [
    (0, 1, None, "0"), (1, 1, None, "0"),          # two local ranks, one GPU: shared
    (3, 2, None, "1"), (5, 8, None, "5"),
    (0, 1, "3", "3"), (1, 1, "4", "4"),            # a launcher gave each rank its own GPU
    (1, 2, "GPU-a, GPU-b", "GPU-b"),
    (2, 4, "6,7", "2"),                            # fewer names than devices: the index
])
def test_gpu_of_names_the_physical_gpu(local_rank, count, visible, gpu):
    from globaltensor.comm.groups import gpu_of
    assert gpu_of(local_rank, count, visible) == gpu


@pytest.mark.parametrize("ranks_on_gpu, count, nccl, vote", [
    (1, 1, True, "nccl"), (1, 8, True, "nccl"),
    (2, 1, True, "gloo"), (3, 8, True, "gloo"),    # NCCL refuses a shared GPU
    (1, 1, False, "gloo"),                         # a torch build without NCCL
    (1, 0, True, None), (2, 0, False, None),       # no GPU: no vote
])
def test_cuda_vote(ranks_on_gpu, count, nccl, vote):
    from globaltensor.comm.groups import cuda_vote
    assert cuda_vote(ranks_on_gpu, count, nccl) == vote


def test_backend_string_keeps_gloo_for_cpu():
    from globaltensor.comm.groups import backend_string
    assert backend_string("nccl") == "cpu:gloo,cuda:nccl"
    assert backend_string("gloo") == "cpu:gloo,cuda:gloo"


@pytest.mark.parametrize("kind, device, backend, staged", [
    ("all_gather", "cuda", "gloo", True), ("all_to_all", "cuda", "gloo", True),
    ("send", "cuda", "gloo", True), ("recv", "cuda", "gloo", True),
    ("all_reduce:max", "cuda", "gloo", True),      # gloo's device all_reduce sums only
    ("all_reduce", "cuda", "gloo", False), ("broadcast", "cuda", "gloo", False),
    ("all_gather", "cuda", "nccl", False), ("send", "cuda", "nccl", False),
    ("all_gather", "cpu", "gloo", False), ("send", "cpu", "gloo", False),
])
def test_stage_through_host(kind, device, backend, staged):
    from globaltensor.comm.groups import stage_through_host
    assert stage_through_host(kind, device, backend) is staged


# --------------------------------------------------------------------------------------
# the ranks' agreement through the store (each rank a thread on one in-memory store)
# --------------------------------------------------------------------------------------

def _agree(ranks: list) -> list:
    """``_agree_on_cuda_backend`` for each rank (host, local rank, device count,
    CUDA_VISIBLE_DEVICES, NCCL available), all at once on one store."""
    import torch.distributed as dist

    from globaltensor.comm.groups import _agree_on_cuda_backend, gpu_of
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    out: list = [None] * len(ranks)
    errors: list = []

    def run(i: int) -> None:
        host, local_rank, count, visible, nccl = ranks[i]
        gpu = gpu_of(local_rank, count, visible) if count else None
        try:
            out[i] = _agree_on_cuda_backend(store, len(ranks), host, gpu, nccl)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_two_local_ranks_on_one_gpu_agree_on_gloo_and_say_why():
    out = _agree([("node", 0, 1, None, True), ("node", 1, 1, None, True)])
    assert [backend for backend, _ in out] == ["gloo", "gloo"]
    assert all("share a GPU" in why and "GPU 0 of node" in why for _, why in out)


def test_a_gpu_per_local_rank_agrees_on_nccl():
    out = _agree([("node", r, 4, None, True) for r in range(4)])
    assert out == [("nccl", "")] * 4


def test_a_gpu_per_rank_by_cuda_visible_devices_agrees_on_nccl():
    # each rank sees one GPU (its own): device_count 1 for 2 local ranks, no sharing
    out = _agree([("node", 0, 1, "0", True), ("node", 1, 1, "1", True)])
    assert out == [("nccl", "")] * 2


def test_one_node_sharing_makes_every_node_use_gloo():
    # node a has a GPU per rank, node b not: all ranks must choose alike
    out = _agree([("a", 0, 2, None, True), ("a", 1, 2, None, True),
                  ("b", 0, 1, None, True), ("b", 1, 1, None, True)])
    assert [backend for backend, _ in out] == ["gloo"] * 4
    assert all("GPU 0 of b" in why for _, why in out)


def test_two_nodes_on_one_machine_share_its_gpus():
    # two launcher nodes on one host (--local_addr 127.0.0.2/3), 2 ranks each, 2 GPUs:
    # LOCAL_WORLD_SIZE <= device_count on each, yet GPU 0 and 1 serve two ranks each
    out = _agree([("host", 0, 2, None, True), ("host", 1, 2, None, True)] * 2)
    assert [backend for backend, _ in out] == ["gloo"] * 4


def test_ranks_without_a_gpu_do_not_vote():
    out = _agree([("gpus", 0, 2, None, True), ("gpus", 1, 2, None, True),
                  ("cpus", 0, 0, None, False)])
    assert out == [("nccl", "")] * 3


def test_no_gpu_anywhere_is_gloo_with_nothing_to_warn():
    assert _agree([("a", 0, 0, None, False), ("b", 0, 0, None, True)]) == [("gloo", "")] * 2


def test_a_rank_without_nccl_makes_every_rank_use_gloo():
    out = _agree([("node", 0, 2, None, True), ("node", 1, 2, None, False)])
    assert [backend for backend, _ in out] == ["gloo", "gloo"]
    assert all("NCCL is not available" in why for _, why in out)


# --------------------------------------------------------------------------------------
# worlds: stand-in GPUs, and the host-copy path on cpu tensors
# --------------------------------------------------------------------------------------

def _stand_in_gpus(count: int) -> dict:
    """Make this process see ``count`` GPUs and NCCL; record what init passes to torch
    (backend, keyword arguments, set_device). The real group is made with gloo for cuda
    (this build has no NCCL)."""
    import torch
    import torch.distributed as dist
    seen: dict = {"set_device": []}
    real_init = dist.init_process_group

    def init_process_group(backend, **kwargs):
        seen["backend"], seen["kwargs"] = backend, kwargs
        return real_init(backend.replace("cuda:nccl", "cuda:gloo"), **kwargs)

    torch.cuda.is_available = lambda: count > 0
    torch.cuda.device_count = lambda: count
    torch.cuda.set_device = lambda device: seen["set_device"].append(torch.device(device))
    dist.is_nccl_available = lambda: True
    dist.init_process_group = init_process_group
    return seen


def _cpu_program_runs_on_one_gpu_shared_by_two_ranks():
    import warnings

    import torch
    import torch.distributed as dist

    import globaltensor as gt
    from globaltensor.comm import collectives, groups
    seen = _stand_in_gpus(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        P = gt.placement.all("cpu")
        x = gt.tensor(torch.arange(6.0), placement=P, sbp=gt.sbp.split(0))
        assert x.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [0.0, 1, 2, 3, 4, 5]
        assert (x * 2).sum().item() == 30.0
    assert not [w for w in caught if "gloo" in str(w.message)], "warned for cpu placements"
    assert seen["backend"] == "cpu:gloo,cuda:gloo", seen
    assert seen["kwargs"].get("device_id") is None, seen
    assert seen["set_device"] == [torch.device("cuda", 0)], seen  # LOCAL_RANK % 1
    assert "share a GPU" in groups._cuda_via_gloo_why
    # the first cuda collective warns, once, and stages what gloo lacks on CUDA
    cuda = torch.device("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert collectives._staged("all_gather", cuda)
        assert not collectives._staged("all_reduce", cuda)
        assert collectives._staged("send", cuda)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1, texts
    assert "share a GPU" in texts[0] and "--nproc_per_node" in texts[0], texts
    assert dist.get_backend() == "cpu:gloo,cuda:gloo"


def _a_gpu_per_rank_chooses_nccl_without_binding_a_device():
    # the world made again (the program destroyed it): the ranks agree anew
    import warnings

    import torch
    import torch.distributed as dist

    import globaltensor as gt
    from globaltensor.comm import collectives, groups
    seen = _stand_in_gpus(2)
    groups._warned_gloo = False  # the first check warned: this one must not
    dist.destroy_process_group()
    P = gt.placement.all("cpu")
    x = gt.tensor(torch.arange(4.0), placement=P, sbp=gt.sbp.split(0))
    assert x.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == [0.0, 1, 2, 3]
    assert seen["backend"] == "cpu:gloo,cuda:nccl", seen
    assert seen["kwargs"].get("device_id") is None, seen
    assert seen["set_device"] == [torch.device("cuda", dist.get_rank())], seen
    assert groups._cuda_via_gloo_why == ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collectives._staged("all_gather", torch.device("cuda"))
    assert not caught, [str(w.message) for w in caught]


def _collectives_on_host_copies():
    # every wrapper through its host-copy path (forced): the code a gloo cuda backend
    # runs for what it lacks, on cpu tensors
    import torch
    import torch.distributed as dist

    from globaltensor import comm
    from globaltensor.comm import collectives
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = tuple(range(world))
    kinds: list = []
    real = collectives._staged
    collectives._staged = lambda kind, device: kinds.append(kind) or True
    try:
        mine = torch.arange(3.0) + 10 * rank
        expected = torch.cat([torch.arange(3.0) + 10 * r for r in ranks])
        out = torch.full((3 * world,), -1.0)
        comm.all_gather_into(out, mine, ranks)
        assert out.tolist() == expected.tolist()
        out = torch.full((3 * world,), -1.0)
        comm.all_gather_async(out, mine, ranks).wait()
        assert out.tolist() == expected.tolist()

        t = torch.tensor([1.0 + rank, 5.0 - rank])
        comm.all_reduce_(t, "max", ranks)
        assert t.tolist() == [float(world), 5.0]
        t = torch.tensor([1.0 + rank])
        comm.all_reduce_(t, "sum", ranks)
        assert t.item() == sum(1.0 + r for r in ranks)
        t = torch.tensor([2.0 * rank])
        comm.all_reduce_async(t, ranks).wait()
        assert t.item() == sum(2.0 * r for r in ranks)

        t = torch.tensor([7.0, 8.0]) if rank == 1 else torch.zeros(2)
        comm.broadcast_(t, 1, ranks)
        assert t.tolist() == [7.0, 8.0]

        inp = torch.tensor([100.0 * rank + j for j in range(world)])  # element j to rank j
        out = torch.full((world,), -1.0)
        comm.all_to_all_single(out, inp, [1] * world, [1] * world, ranks)
        assert out.tolist() == [100.0 * r + rank for r in ranks]

        peer = 1 - rank
        got = torch.full((2,), -1.0)
        comm.batched_p2p([(torch.tensor([rank, 1.0 + rank]), peer)], [(got, peer)])
        assert got.tolist() == [float(peer), 1.0 + peer]
        got = torch.full((1,), -1.0)
        (comm.start_p2p([(torch.tensor([3.0]), peer)], []) if rank == 0
         else comm.start_p2p([], [(got, peer)])).wait()      # one message
        assert rank == 0 or got.item() == 3.0

        whole = torch.full((5,), -1.0)
        pieces = [whole[:3], whole[3:]]
        comm.all_gather_p2p(pieces, torch.arange(3.0) if rank == 0 else torch.tensor([7.0, 8.0]),
                            ranks).wait()
        assert whole.tolist() == [0.0, 1.0, 2.0, 7.0, 8.0]

        inp = torch.tensor([1.0 + rank, 10.0 + rank])     # chunk j reduced onto rank j
        got = torch.full((1,), -1.0)
        comm.reduce_scatter_into(got, inp, "sum", ranks)
        assert got.item() == sum([1.0 + r, 10.0 + r][rank] for r in ranks)
    finally:
        collectives._staged = real
    for kind in ("all_gather", "all_reduce", "all_reduce:max", "broadcast", "all_to_all",
                 "send", "recv", "reduce_scatter"):
        assert kind in kinds, (kind, kinds)


def _traced_collectives_on_host_copies():
    # the traced collectives (torch.compile's form) through their host-copy path
    # (forced), as a graph holds them where a gloo cuda backend lacks one: a compiled
    # all-gather of cuda tensors on gloo crashed the ranks before
    import torch
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from globaltensor import comm
    from globaltensor.comm import collectives
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = tuple(range(world))

    def collectives_of(mine, t, inp):
        gathered = torch.empty(3 * world)
        comm.all_gather_into(gathered, mine, ranks)
        top = t.clone()
        comm.all_reduce_(top, "max", ranks)
        swapped = torch.empty(world)
        comm.all_to_all_single(swapped, inp, [1] * world, [1] * world, ranks)
        scattered = torch.empty(1)
        comm.reduce_scatter_into(scattered, inp, "sum", ranks)
        sent = t.clone()
        comm.broadcast_(sent, 1, ranks)
        return gathered, top, swapped, scattered, sent

    kinds: list = []
    real = collectives._staged
    collectives._staged = lambda kind, device: kinds.append(kind) or True
    mine, t = torch.arange(3.0) + 10 * rank, torch.tensor([1.0 + rank, 5.0 - rank])
    inp = torch.tensor([100.0 * rank + j for j in range(world)])
    try:
        graph = make_fx(collectives_of)(mine, t, inp)
    finally:
        collectives._staged = real
    assert {"all_gather", "all_reduce:max", "all_to_all", "reduce_scatter",
            "broadcast"} <= set(kinds), kinds
    gathered, top, swapped, scattered, sent = graph(mine, t, inp)
    assert gathered.tolist() == torch.cat([torch.arange(3.0) + 10 * r for r in ranks]).tolist()
    assert top.tolist() == [float(world), 5.0]
    assert swapped.tolist() == [100.0 * r + rank for r in ranks]
    assert scattered.item() == sum(100.0 * r + rank for r in ranks)
    assert sent.tolist() == [2.0, 4.0]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_worlds_with_stand_in_gpus_and_the_host_copy_path():
    names = ["_cpu_program_runs_on_one_gpu_shared_by_two_ranks",
             "_collectives_on_host_copies", "_traced_collectives_on_host_copies",
             "_a_gpu_per_rank_chooses_nccl_without_binding_a_device"]
    world = World(2, __name__, names)
    for name in names:
        world.check(name)


# --------------------------------------------------------------------------------------
# on a real GPU machine (skipped without CUDA)
# --------------------------------------------------------------------------------------

def _cuda_placement_moves_on_whatever_gpus_there_are():
    import warnings

    import torch
    import torch.distributed as dist

    import globaltensor as gt
    from globaltensor.comm import groups
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        C = gt.placement("cpu", [0, 1])
        y = gt.tensor(torch.arange(8.0), placement=C, sbp=gt.sbp.split(0))
        assert y.to_global(sbp=gt.sbp.broadcast).to_local().tolist() == list(map(float, range(8)))
        assert not [w for w in caught if "gloo" in str(w.message)]
        P = gt.placement("cuda", [0, 1])
        x = gt.tensor(torch.arange(8.0), placement=P, sbp=gt.sbp.split(0))
        gpu = dist.get_rank() % torch.cuda.device_count()   # LOCAL_RANK % device_count
        assert x.to_local().device == torch.device("cuda", gpu)
        b = x.to_global(sbp=gt.sbp.broadcast)                       # all-gather
        assert b.to_local().cpu().tolist() == list(map(float, range(8)))
        s = b.to_global(sbp=gt.sbp.split(0)).to_global(sbp=gt.sbp.split(0))
        assert s.full().cpu().tolist() == list(map(float, range(8)))
        m = x.reshape(2, 4).to_global(sbp=gt.sbp.split(1))         # all-to-all
        assert m.full().cpu().tolist() == [[0.0, 1, 2, 3], [4, 5, 6, 7]]
        z = x.to_global(placement=gt.placement("cuda", [1]), sbp=gt.sbp.broadcast)  # p2p
        assert z.full().cpu().tolist() == list(map(float, range(8)))
        assert (x * 2).sum().item() == 56.0                          # all-reduce
    nccl = torch.cuda.device_count() >= 2 and dist.is_nccl_available()
    assert groups.device_backend("cuda") == ("nccl" if nccl else "gloo")
    warned = [str(w.message) for w in caught
              if "cuda collectives go through gloo" in str(w.message)]
    assert len(warned) == (0 if nccl else 1), warned


@pytest.mark.cuda
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_cuda_placements_on_this_machines_gpus():
    World(2, __name__, ["_cuda_placement_moves_on_whatever_gpus_there_are"]).check(
        "_cuda_placement_moves_on_whatever_gpus_there_are")
