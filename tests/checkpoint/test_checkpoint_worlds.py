"""Checkpoints through torch.distributed.checkpoint across layouts and world sizes.

One world of 4 saves a state dict holding every kind of layout (uneven and
smaller-than-rank-count splits, broadcast, partial sum/max, 2-D meshes, a sub-placement,
0-d, empty, bf16, plain tensors, non-tensors) and loads it back into other layouts; a
world of 2 then loads that checkpoint (4 -> 2 ranks), resumes an optimizer through
torch's get_state_dict/set_state_dict (also as whole plain values, full_state_dict=True),
and saves one that this (plain, undistributed) process loads into plain tensors. Values
are small integers, so every comparison is exact.
The worlds are simulated (each one process running its ranks as threads, through the same
dcp and store code); the launched jobs of test_resume.py and test_autosave.py save and
load from processes.
"""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp import World

import globaltensor as gt
from globaltensor.layout import Layout, Region

pytestmark = pytest.mark.multiprocess  # every test here runs in a world of processes

S, B = gt.sbp.split, gt.sbp.broadcast
PSUM, PMAX = gt.sbp.partial_sum, gt.sbp.partial_max


def value(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    """The saved value of ``name``: small integers, different per name."""
    numel = torch.Size(shape).numel()
    start = sum(map(ord, name)) % 13
    return ((torch.arange(numel) % 37) + start).reshape(shape).to(dtype)


def placements(n: int) -> dict:
    out = {"all": gt.placement.all("cpu"), "sub": gt.placement("cpu", list(range(1, n, 2)))}
    if n == 4:
        out["mesh"] = gt.placement("cpu", [[0, 1], [2, 3]])
    return out


# name -> (shape, dtype, placement key, sbp, partial addend factor per mesh coordinate)
SAVED = {
    "s0_uneven": ((7, 3), torch.float32, "all", S(0)),
    "s1_small": ((3, 2), torch.float32, "all", S(1)),      # 2 columns over 4 ranks
    "b": ((3, 5), torch.float64, "all", B),
    "psum": ((4, 3), torch.float32, "all", PSUM),
    "pmax": ((5,), torch.float32, "all", PMAX),
    "mesh_ss": ((6, 5), torch.float32, "mesh", (S(0), S(1))),
    "mesh_bs": ((5, 4), torch.float32, "mesh", (B, S(0))),
    "mesh_ps": ((3, 4), torch.float32, "mesh", (PSUM, S(1))),
    "mesh_s0s0": ((9, 2), torch.float32, "mesh", (S(0), S(0))),
    "sub": ((5, 2), torch.int64, "sub", S(0)),
    "scalar": ((), torch.float32, "all", B),
    "empty": ((0, 3), torch.float32, "all", S(0)),
    "bf16": ((6,), torch.bfloat16, "all", S(0)),
}


def make(name, shape, dtype, placement, sbp) -> gt.GlobalTensor:
    """``value(name)`` in this layout; partial layouts get a real addend on every rank
    (scaled copies whose sum / max is the value), not the value on one rank."""
    v = value(name, shape, dtype)
    layout = Layout.make(shape, placement, sbp)
    if not layout.partial_axes:
        return gt.tensor(v, placement=placement, sbp=sbp)
    rank = gt.get_rank()
    if rank not in placement:
        local = torch.empty(0)
    else:
        local = v[layout.region(rank).slices()].clone()
        coord = placement.coord(rank)
        for axis in layout.partial_axes:
            size, c = placement.shape[axis], coord[axis]
            if layout.sbp[axis].reduce == "sum":  # weights 1/2, 1/4, ..., sum 1 (exact)
                local = local * 2.0 ** -min(c + 1, size - 1)
            else:
                local = local - c
    return gt.from_local(local.to(dtype), placement=placement, sbp=sbp, shape=shape)


def saved_state(n: int) -> dict:
    P = placements(n)
    state = {name: make(name, shape, dtype, P[p], sbp)
             for name, (shape, dtype, p, sbp) in SAVED.items() if p in P}
    state["plain"] = value("plain", (4,))
    state["nested"] = {"x": make("x", (4, 4), torch.float32, P["all"], S(1)), "step": 7}
    return state


def targets(n: int) -> dict:
    """Each saved tensor in another layout (or as a plain tensor)."""
    P = placements(n)
    other = {
        "s0_uneven": ("mesh", (S(1), S(0))), "s1_small": ("all", B), "b": ("sub", S(1)),
        "psum": ("all", S(0)), "pmax": ("mesh", (PMAX, B)), "mesh_ss": ("all", S(1)),
        "mesh_bs": ("all", PSUM), "mesh_ps": (None, None), "mesh_s0s0": ("sub", S(0)),
        "sub": ("mesh", (S(0), B)), "scalar": ("all", PSUM), "empty": ("all", B),
        "bf16": ("sub", S(0)),
    }
    if n == 2:  # no mesh: 1-D stand-ins
        other.update({"s0_uneven": ("all", S(1)), "pmax": ("all", PMAX),
                      "sub": ("all", B)})
    out = {}
    for name, (shape, dtype, _, _) in SAVED.items():
        key, sbp = other[name]
        if key is None:
            out[name] = torch.zeros(shape, dtype=dtype)
        else:
            out[name] = gt.zeros(*shape, placement=P[key], sbp=sbp, dtype=dtype)
    out["plain"] = gt.zeros(4, placement=P["all"], sbp=S(0))
    out["nested"] = {"x": gt.zeros(4, 4, placement=P["sub"], sbp=B), "step": 0}
    return out


def _whole(x) -> torch.Tensor:
    return x.full() if gt.is_global(x) else x


def check_loaded(state: dict) -> None:
    for name, (shape, dtype, _, _) in SAVED.items():
        got = _whole(state[name])
        assert got.dtype == dtype, (name, got.dtype)
        assert torch.equal(got, value(name, shape, dtype)), (name, got)
    assert torch.equal(_whole(state["plain"]), value("plain", (4,)))
    assert torch.equal(_whole(state["nested"]["x"]), value("x", (4, 4)))
    assert state["nested"]["step"] == 7


def _root() -> str:
    return os.environ["CKPT_ROOT"]


def _flat(state: dict, prefix="") -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# --- world of 4 ------------------------------------------------------------------------

def save_every_layout():
    dcp.save(saved_state(4), checkpoint_id=f"{_root()}/w4")


def every_element_written_once_by_a_holder():
    """Chunks tile each tensor exactly, and the rank whose file holds a chunk holds
    that region (a partial tensor: of its reduced value)."""
    md = dcp.FileSystemReader(f"{_root()}/w4").read_metadata()
    state = _flat(saved_state(4))
    writers = {}
    for index, info in md.storage_data.items():
        writers[(index.fqn, tuple(index.offset or ()))] = int(info.relative_path.split("_")[2])
    for fqn, x in state.items():
        if not gt.is_global(x):
            continue
        chunks = md.state_dict_metadata[fqn].chunks
        regions = [Region(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
        assert sum(r.numel for r in regions) == x.numel(), (fqn, regions)
        for i, a in enumerate(regions):
            for b in regions[i + 1:]:
                assert a.intersect(b) is None, (fqn, a, b)
            if x.numel() == 0:
                continue
            writer = writers[(fqn, a.offsets)]
            held = x.global_layout.region(writer)
            assert held is not None and held.intersect(a) == a, (fqn, writer, held, a)
            coord = x.placement.coord(writer)
            assert all(coord[axis] == 0 for axis in x.global_layout.partial_axes), (fqn, writer)
    # Replicated tensors are spread over ranks by DCP's dedup, not all written by rank 0.
    assert len({w for (f, _), w in writers.items() if f in ("b", "scalar", "plain")}) > 1, \
        writers


def load_into_other_layouts():
    with gt.debug.comm_stats() as stats:
        state = targets(4)
        comm_before = stats.total_calls
        dcp.load(state, checkpoint_id=f"{_root()}/w4")
        # Each rank reads its own region: no global tensor is boxed or gathered.
        assert stats.total_calls == comm_before, stats
    check_loaded(state)
    partial = state["mesh_bs"]  # loaded into partial_sum: first rank holds it, others 0
    if gt.get_rank() != 0:
        assert not partial.to_local().any()


def load_into_the_same_layouts():
    state = saved_state(4)
    for x in _flat(state).values():
        if gt.is_global(x):
            x.to_local().zero_()
    dcp.load(state, checkpoint_id=f"{_root()}/w4")
    check_loaded(state)


def bytes_on_disk_close_to_the_state():
    n = 4
    P = gt.placement.all("cpu")
    big = {"w": gt.ones(512, 256, placement=P, sbp=S(0)), "b": gt.ones(256, 512, placement=P, sbp=B),
           "m": gt.ones(128, 512, placement=gt.placement("cpu", [[0, 1], [2, 3]]),
                        sbp=(S(1), B))}
    path = f"{_root()}/big{n}"
    dcp.save(big, checkpoint_id=path)
    state_bytes = sum(x.numel() * x.element_size() for x in big.values())
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert on_disk <= 1.05 * state_bytes, (on_disk, state_bytes)


W4 = ["save_every_layout", "every_element_written_once_by_a_holder", "load_into_other_layouts",
      "load_into_the_same_layouts", "bytes_on_disk_close_to_the_state"]


# --- world of 2 ------------------------------------------------------------------------

def load_from_four_ranks():
    state = targets(2)
    dcp.load(state, checkpoint_id=f"{_root()}/w4")
    check_loaded(state)


def save_for_a_plain_process():
    dcp.save(saved_state(2), checkpoint_id=f"{_root()}/w2")


def load_a_plain_checkpoint():
    """A checkpoint saved by one process with plain tensors loads into global ones."""
    state = targets(2)
    state["nested"] = {"x": state["nested"]["x"], "step": 0}
    dcp.load(state, checkpoint_id=f"{_root()}/plain")
    check_loaded(state)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


DATA_PARALLEL = lambda name, t: B  # noqa: E731
TENSOR_PARALLEL = {"fc1.weight": S(0), "fc1.bias": S(0), "fc2.weight": S(1)}


def _model(layout):
    torch.manual_seed(0)
    model = Net()
    choose = layout if callable(layout) else (lambda name, t: layout.get(name, B))
    return gt.nn.to_global(model, gt.placement.all("cpu"), choose)


def _steps(model, opt, steps, first):
    g = torch.Generator().manual_seed(first)
    P = gt.placement.all("cpu")
    for _ in range(steps):
        x = gt.tensor(torch.randn(8, 6, generator=g), placement=P, sbp=S(0))
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def optimizer_state_through_get_and_set_state_dict():
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    path = f"{_root()}/optim"
    model = _model(DATA_PARALLEL)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _steps(model, opt, 3, first=1)
    model_sd, optim_sd = get_state_dict(model, opt)
    for name, p in model.named_parameters():
        moment = optim_sd["state"][name]["exp_avg"]
        assert gt.is_global(moment) and moment.global_layout == p.global_layout, (name, moment)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _steps(model, opt, 2, first=2)  # the uninterrupted run

    resumed = _model(TENSOR_PARALLEL)
    opt2 = torch.optim.Adam(resumed.parameters(), lr=0.05)
    model_sd, optim_sd = get_state_dict(resumed, opt2)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(resumed, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for name, p in resumed.named_parameters():
        state = opt2.state[p]
        assert state["exp_avg_sq"].global_layout == p.global_layout, name
        assert float(state["step"]) == 3
    _steps(resumed, opt2, 2, first=2)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert b.sbp == ((TENSOR_PARALLEL.get(name, B)),), (name, b.sbp)
        torch.testing.assert_close(a.full(), b.full(), rtol=0, atol=1e-6, msg=name)


def full_state_dicts_through_get_state_dict():
    """StateDictOptions(full_state_dict=True) gives plain tensors of the whole values (on
    rank 0 only with cpu_offload=True), as for DTensors; torch.save takes them, and
    set_state_dict loads them into another layout that trains on as the first."""
    import io

    from torch.distributed.checkpoint import state_dict as sd
    model = _model(TENSOR_PARALLEL)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _steps(model, opt, 2, first=3)
    last = gt.nn.to_global(torch.nn.Linear(3, 2), gt.placement("cpu", [1]), B)  # one rank's
    full = sd.StateDictOptions(full_state_dict=True)
    for name, t in sd.get_model_state_dict(model, options=full).items():
        assert type(t) is torch.Tensor, (name, type(t))
        assert torch.equal(t, model.state_dict()[name].full()), name
    offload = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    got, want = sd.get_model_state_dict(last, options=offload), last.weight.full()
    if gt.get_rank() == 0:
        assert type(got["weight"]) is torch.Tensor and torch.equal(got["weight"], want)
    else:
        assert got == {}, got
    model_sd, optim_sd = sd.get_state_dict(model, opt, options=offload)
    moments = {name: opt.state[p]["exp_avg"].full() for name, p in model.named_parameters()}
    if gt.get_rank() == 0:
        for name, want in moments.items():
            moment = optim_sd["state"][name]["exp_avg"]
            assert type(moment) is torch.Tensor, (name, type(moment))
            assert torch.equal(moment, want), name
        torch.save({"model": model_sd, "optim": optim_sd}, io.BytesIO())
    else:
        assert model_sd == {} and optim_sd == {}, (model_sd, optim_sd)
    saved = io.BytesIO()   # (a file: the whole values alias the broadcast parts, as torch's)
    torch.save(sd.get_state_dict(model, opt, options=full), saved)
    saved.seek(0)
    model_sd, optim_sd = torch.load(saved)
    resumed, first_only = _model(DATA_PARALLEL), _model(TENSOR_PARALLEL)
    opt2 = torch.optim.Adam(resumed.parameters(), lr=0.05)
    opt3 = torch.optim.Adam(first_only.parameters(), lr=0.05)
    sd.set_state_dict(resumed, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd,
                      options=full)
    saved.seek(0)   # (set_state_dict put the loaded model's tensors in the dicts given)
    model_sd, optim_sd = torch.load(saved)
    on_first = gt.get_rank() == 0   # the values given on rank 0 only
    from_first = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd.set_model_state_dict(first_only, model_sd if on_first else {}, options=from_first)
    sd.set_optimizer_state_dict(first_only, opt3, optim_sd if on_first else {}, options=from_first)
    for trained, optimizer in ((model, opt), (resumed, opt2), (first_only, opt3)):
        _steps(trained, optimizer, 2, first=4)
    for (name, a), b, c in zip(model.named_parameters(), resumed.parameters(),
                               first_only.parameters()):
        torch.testing.assert_close(a.full(), b.full(), rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(a.full(), c.full(), rtol=0, atol=1e-6, msg=name)


def half_written_checkpoint_is_refused():
    path, broken = f"{_root()}/w2", f"{_root()}/w2_broken"
    if gt.get_rank() == 0:
        import shutil
        shutil.copytree(path, broken, ignore=shutil.ignore_patterns(".metadata"))
    import torch.distributed as dist
    dist.barrier()
    assert not gt.checkpoint.is_complete(broken) and gt.checkpoint.is_complete(path)
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException, match=r"No such file .*w2_broken/\.metadata"):
        dcp.load(targets(2), checkpoint_id=broken)
    assert gt.checkpoint.latest(_root()) is not None
    assert not gt.checkpoint.latest(_root()).endswith("broken")


W2 = ["load_from_four_ranks", "save_for_a_plain_process", "load_a_plain_checkpoint",
      "optimizer_state_through_get_and_set_state_dict", "full_state_dicts_through_get_state_dict",
      "half_written_checkpoint_is_refused"]


# --- fixtures: the plain checkpoint first, then 4 ranks, then 2 -------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    plain = {name: value(name, shape, dtype) for name, (shape, dtype, _, _) in SAVED.items()}
    plain["plain"] = value("plain", (4,))
    plain["nested"] = {"x": value("x", (4, 4)), "step": 7}
    dcp.save(plain, checkpoint_id=str(path / "plain"), no_dist=True)
    return path


@pytest.fixture(scope="module")
def world4(root):
    return World(4, __name__, W4, env={"CKPT_ROOT": str(root)}, simulated=True)


@pytest.fixture(scope="module")
def world2(root, world4):
    return World(2, __name__, W2, env={"CKPT_ROOT": str(root)}, simulated=True)


@pytest.mark.parametrize("name", W4)
def test_world4(world4, name):
    world4.check(name)


@pytest.mark.parametrize("name", W2)
def test_world2(world2, name):
    world2.check(name)


@pytest.mark.parametrize("saved", ["w2", "w4"])
def test_global_checkpoint_loads_into_plain_tensors(root, world2, saved):
    """No process group here: a global checkpoint gives whole values to plain tensors."""
    world2.check("save_for_a_plain_process")
    state = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype, p, _) in SAVED.items()
             if saved == "w4" or p != "mesh"}
    state["plain"] = torch.zeros(4)
    state["nested"] = {"x": torch.zeros(4, 4), "step": 0}
    dcp.load(state, checkpoint_id=str(root / saved), no_dist=True)
    for name, t in state.items():
        if name in SAVED:
            shape, dtype = SAVED[name][:2]
            assert torch.equal(t, value(name, shape, dtype)), name
    assert torch.equal(state["nested"]["x"], value("x", (4, 4)))
    assert state["nested"]["step"] == 7
