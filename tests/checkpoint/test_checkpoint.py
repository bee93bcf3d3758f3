"""One process: torch.save and pickle refuse GlobalTensors, naming DCP, before a file is
touched; ordinary torch.save keeps working; checkpoint directory helpers."""
import io
import os
import pickle

import pytest
import torch

import globaltensor as gt


@pytest.fixture
def model():
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    return gt.nn.to_global(m, gt.placement("cpu", [0]), gt.sbp.broadcast)


def test_torch_save_of_a_global_state_dict_leaves_an_existing_file_intact(tmp_path, model):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(100.0)}, path)
    good = path.read_bytes()
    for obj in [model.state_dict(), {"nested": [1, {"deep": model[0].weight}]}, model]:
        with pytest.raises(TypeError, match=r"torch\.distributed\.checkpoint.*dcp\.save"):
            torch.save(obj, path)
        assert path.read_bytes() == good
    with pytest.raises(TypeError, match="GlobalTensor"):
        torch.serialization.save(model.state_dict(), str(path))
    assert torch.equal(torch.load(path)["w"], torch.arange(100.0))


def test_torch_save_names_full_state_dict_for_a_plain_file(model):
    """A user who wants a plain .pt of whole values is told how to get one."""
    with pytest.raises(TypeError, match=r"torch\.save\(gt\.nn\.full_state_dict\(model\)"):
        torch.save(model.state_dict(), io.BytesIO())
    whole = gt.nn.full_state_dict(model)
    buf = io.BytesIO()
    torch.save(whole, buf)
    back = torch.load(io.BytesIO(buf.getvalue()))
    assert torch.equal(back["0.weight"], model[0].weight.full())


def test_torch_save_into_a_buffer_writes_nothing(model):
    buf = io.BytesIO()
    with pytest.raises(TypeError, match="dcp"):
        torch.save(model.state_dict(), buf)
    assert buf.getvalue() == b""


def test_pickle_names_dcp(model):
    with pytest.raises(TypeError, match="dcp.save"):
        pickle.dumps(model[0].weight.detach())


def test_plain_objects_still_save_and_load(tmp_path):
    obj = {"t": torch.randn(3, 4), "view": torch.arange(10)[2:5], "n": 3, "s": "x",
           "m": torch.nn.Linear(2, 2)}
    torch.save(obj, tmp_path / "plain.pt")
    back = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert torch.equal(back["t"], obj["t"]) and torch.equal(back["view"], obj["view"])
    assert torch.equal(back["m"].weight, obj["m"].weight)


def test_unpicklable_objects_fail_as_in_torch(tmp_path):
    """The guard reports only GlobalTensors; other pickling errors stay torch's own."""
    with pytest.raises(Exception) as guarded:
        torch.save({"f": lambda: 0}, tmp_path / "a.pt")
    with pytest.raises(Exception) as plain:
        torch.save.__wrapped__({"f": lambda: 0}, tmp_path / "b.pt")
    assert type(guarded.value) is type(plain.value)


def test_latest_complete_checkpoint(tmp_path):
    assert gt.checkpoint.latest(tmp_path) is None
    for step, complete in [(5, True), (10, True), (15, False)]:
        d = tmp_path / f"step_{step}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (d / ".metadata").write_bytes(b"x")
    assert gt.checkpoint.is_complete(tmp_path / "step_10")
    assert not gt.checkpoint.is_complete(tmp_path / "step_15")
    assert gt.checkpoint.latest(tmp_path) == os.path.join(str(tmp_path), "step_10")


def test_rng_state_round_trip_through_dcp(tmp_path):
    """Saved with DCP and loaded into the template of a fresh run (whose tensors still
    describe that run's own state) it gives the saved run's next draws."""
    import torch.distributed.checkpoint as dcp
    P = gt.placement("cpu", [0])
    gt.manual_seed(3)
    gt.randn(4, placement=P, sbp=gt.sbp.broadcast)
    dcp.save({"rng": gt.checkpoint.rng_state()}, checkpoint_id=tmp_path / "rng")
    a = gt.randn(5, placement=P, sbp=gt.sbp.broadcast).full()
    b = torch.rand(2)
    gt.manual_seed(99)
    template = {"rng": gt.checkpoint.rng_state()}
    dcp.load(template, checkpoint_id=tmp_path / "rng")
    gt.checkpoint.set_rng_state(template["rng"])
    assert torch.equal(gt.randn(5, placement=P, sbp=gt.sbp.broadcast).full(), a)
    assert torch.equal(torch.rand(2), b)
