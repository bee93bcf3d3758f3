"""Importing globaltensor changes in torch exactly what docs/torch_changes.md lists (in a
fresh process: every attribute of every torch module and of every class torch defines,
the _foreach_ type lists, sys.meta_path, the random state, hooks, warnings filters and
registered backends, before and after ``import globaltensor``), with
GLOBALTENSOR_LOCAL_ADDR and GLOBALTENSOR_TORCH_ADVICE set or not; and every function left
in torch's place does what torch's own does on plain tensors."""
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import globaltensor  # noqa: F401  (the changes under test)

DOC = Path(__file__).resolve().parents[2] / "docs" / "torch_changes.md"

SNAPSHOT = textwrap.dedent('''
    import json, logging, signal, sys, threading, types, warnings
    warnings.simplefilter("ignore")      # torch's deprecated attributes, read below
    import torch, torch.distributed, torch.distributed.checkpoint, torch.optim
    import torch.distributed.checkpoint.state_dict
    import torch.nn.functional, torch.utils, torch.utils.checkpoint, torch.serialization
    import torch.nn.utils.clip_grad, torch.random
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    def attributes():
        """Every attribute of every torch module (modules aside), and of every class a
        torch module defines, by identity."""
        out = {}
        for name, module in list(sys.modules.items()):
            if not name.startswith("torch") or not isinstance(module, types.ModuleType):
                continue
            for key, value in list(vars(module).items()):
                if isinstance(value, types.ModuleType):
                    continue
                out[f"{name}.{key}"] = value
                if (isinstance(value, type) and value.__module__ == name
                        and key == value.__name__):
                    for attr, member in list(vars(value).items()):
                        out[f"{name}.{key}.{attr}"] = member
        return out

    LISTS = {"torch.optim.optimizer._foreach_supported_types":
                 optimizer._foreach_supported_types,
             "torch.utils._foreach_utils._foreach_supported_types":
                 _foreach_utils._foreach_supported_types}

    def state():
        """What else a program could notice, by value."""
        return {"rng": torch.get_rng_state().tolist(), "dtype": str(torch.get_default_dtype()),
                "grad": torch.is_grad_enabled(), "threads": torch.get_num_threads(),
                "excepthook": id(sys.excepthook), "thread hook": id(threading.excepthook),
                "signals": [id(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)],
                "warnings": [repr(f) for f in warnings.filters],
                "loggers": [logging.getLogger(n).level for n in ("", "torch")],
                # (a backend registered with torch changes how it makes groups of
                # several backends: "cpu:gloo,cuda:gloo" then has no default one)
                "backends": [list(torch.distributed.Backend.backend_list),
                             sorted(torch.distributed.Backend._plugins)]}

    before, lists, finders, was = attributes(), {k: list(v) for k, v in LISTS.items()}, \\
        list(sys.meta_path), state()
    modules = set(sys.modules)
    import globaltensor
    after = attributes()
    changed = [k for k, v in before.items() if after.get(k, before) is not v]
    # public names added to a module torch had loaded already (those of the modules
    # globaltensor's import loads are new as a whole)
    changed += [k for k in after if k not in before and k.rsplit(".", 1)[0] in modules
                and not k.rsplit(".", 1)[1].startswith("_")]
    # a class replaced: its name is the change, not each of its members
    changed = [k for k in changed if k.rsplit(".", 1)[0] not in changed]
    changed += [k for k, v in LISTS.items() if list(v) != lists[k]]
    changed += ["sys.meta_path"] if sys.meta_path != finders else []
    changed += [f"state: {k}" for k, v in state().items() if v != was[k]]
    print(json.dumps(sorted(changed)))
''')


def documented() -> dict:
    """docs/torch_changes.md's table: "made" column -> the backquoted names of its rows."""
    rows: dict = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        rows.setdefault(cells[1], set()).update(re.findall(r"`([^`]+)`", cells[0]))
    return rows


def changes(**env) -> set:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("GLOBALTENSOR_LOCAL_ADDR", "GLOBALTENSOR_TORCH_ADVICE")}
    out = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True,
                         timeout=240, env={**environ, **env})
    assert out.returncode == 0, out.stdout + out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


ALWAYS = "at import"
ADVICE = "at import, unless `GLOBALTENSOR_TORCH_ADVICE=0`"
LOCAL_ADDR = "at import, with `GLOBALTENSOR_LOCAL_ADDR` set"
FIRST_USE = "at first use: the first `dcp.load` planning into a GlobalTensor"


def test_the_docs_table_has_the_rows_the_test_reads():
    rows = documented()
    assert set(rows) == {ALWAYS, ADVICE, LOCAL_ADDR, FIRST_USE}, set(rows)
    assert "torch.save" in rows[ALWAYS] and "sys.meta_path" in rows[ADVICE]


@pytest.mark.timeout(300)
def test_import_changes_exactly_what_the_docs_list():
    rows = documented()
    assert changes() == rows[ALWAYS] | rows[ADVICE]


@pytest.mark.timeout(300)
def test_without_advice_the_import_hook_and_torch_tools_stay_torch_own():
    rows = documented()
    assert changes(GLOBALTENSOR_TORCH_ADVICE="0") == rows[ALWAYS]


@pytest.mark.timeout(300)
def test_gloo_is_bound_only_with_a_local_address():
    rows = documented()
    assert changes(GLOBALTENSOR_LOCAL_ADDR="127.0.0.1", GLOBALTENSOR_TORCH_ADVICE="0") == \
        rows[ALWAYS] | rows[LOCAL_ADDR]


def test_advice_off_removes_the_hook_and_unwraps_on_reread(monkeypatch):
    """A worker forked from a process that imported globaltensor with the hook on, whose
    own environment turns it off (env.reread), gets torch's functions back, and the
    hook back again when it is on."""
    import torch.distributed.checkpoint.state_dict as dcp_state_dict
    import torch.distributed.fsdp as fsdp

    from globaltensor import env
    from globaltensor.interop import torch_patches
    assert hasattr(fsdp.fully_shard, "__wrapped_by_globaltensor__")
    original = fsdp.fully_shard.__wrapped_by_globaltensor__
    gather = dcp_state_dict._gather_state_dict.__wrapped_by_globaltensor__
    try:
        monkeypatch.setenv("GLOBALTENSOR_TORCH_ADVICE", "0")
        env.reread()
        assert fsdp.fully_shard is original and dcp_state_dict._gather_state_dict is gather
        assert not any(isinstance(f, torch_patches._Finder) for f in sys.meta_path)
    finally:
        monkeypatch.delenv("GLOBALTENSOR_TORCH_ADVICE")
        env.reread()
    assert fsdp.fully_shard.__wrapped_by_globaltensor__ is original
    assert dcp_state_dict._gather_state_dict.__wrapped_by_globaltensor__ is gather
    assert sum(isinstance(f, torch_patches._Finder) for f in sys.meta_path) == 1


def test_gloo_binding_is_undone_without_a_local_address(monkeypatch):
    import torch.distributed as dist

    from globaltensor import env
    from globaltensor.comm import groups
    monkeypatch.delenv("GLOBALTENSOR_LOCAL_ADDR", raising=False)
    env.reread()
    assert dist.ProcessGroupGloo is groups._TORCH_GLOO
    try:
        monkeypatch.setenv("GLOBALTENSOR_LOCAL_ADDR", "127.0.0.1")
        env.reread()
        assert isinstance(dist.distributed_c10d.ProcessGroupGloo, groups._GlooOnAddress)
    finally:
        monkeypatch.delenv("GLOBALTENSOR_LOCAL_ADDR")
        env.reread()
    assert dist.ProcessGroupGloo is groups._TORCH_GLOO
    assert dist.distributed_c10d.ProcessGroupGloo is groups._TORCH_GLOO


# --- each function left in torch's place: torch's own result on plain tensors -----------

def original(fn):
    return fn.__wrapped_by_globaltensor__


def test_functionals_on_plain_tensors_are_torch_own():
    x = torch.tensor([0, 3, 1])
    assert torch.equal(F.one_hot(x, 5), original(F.one_hot)(x, 5))
    w, i, o = torch.randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 2])
    assert torch.equal(F.embedding_bag(i, w, o, mode="max"),
                       original(F.embedding_bag)(i, w, o, mode="max"))
    q, k, v = torch.randn(3, 2, 4, 8).unbind(0)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       original(F.scaled_dot_product_attention)(q, k, v, is_causal=True))
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    assert torch.equal(torch.einsum("bij,bjk->bik", a, b),
                       original(torch.einsum)("bij,bjk->bik", a, b))
    assert torch.equal(torch.einsum("ii", torch.eye(3)), original(torch.einsum)("ii", torch.eye(3)))


@pytest.mark.parametrize("name, shape", [("dropout", (4, 6)), ("dropout1d", (2, 3, 5)),
                                         ("dropout2d", (2, 3, 4, 4)),
                                         ("dropout3d", (2, 3, 2, 2, 2))])
def test_dropout_on_plain_tensors_draws_torch_own_mask(name, shape):
    fn, x = getattr(F, name), torch.randn(shape)
    torch.manual_seed(7)
    ours = fn(x, 0.4, training=True)
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(ours, original(fn)(x, 0.4, training=True))
    assert torch.equal(torch.rand(3), after)  # the generator advanced alike
    assert torch.equal(fn(x, 0.4, training=False), x)


def test_clip_grad_norm_on_plain_tensors_is_torch_own():
    from torch.nn.utils import clip_grad

    def grads():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
        for p in ps:
            p.grad = torch.randn_like(p) * 10
        return ps

    ps, ref = grads(), grads()
    norm = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=False)
    grads_ref = [p.grad for p in ref]
    ref_norm = original(clip_grad._get_total_norm)(grads_ref, 2.0, False, False)
    original(clip_grad._clip_grads_with_norm_)(ref, 1.0, ref_norm, False)
    assert torch.equal(norm, ref_norm)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(ps, ref))
    assert torch.equal(torch.nn.utils.get_total_norm(grads_ref, 3.0),
                       original(torch.nn.utils.get_total_norm)(grads_ref, 3.0))


def test_full_state_dicts_of_plain_tensors_are_torch_own():
    """No process group: get/set_model_state_dict with full_state_dict=True run torch's
    own functions (through the wrappers) on a plain model."""
    from torch.distributed.checkpoint import state_dict as sd
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    assert all(hasattr(getattr(sd, name), "__wrapped_by_globaltensor__")
               for name in ("_gather_state_dict", "_distribute_state_dict", "_broadcast_state_dict"))
    full = sd.StateDictOptions(full_state_dict=True)
    state = sd.get_model_state_dict(model, options=full)
    assert state.keys() == model.state_dict().keys()
    assert all(state[k] is v or torch.equal(state[k], v) for k, v in model.state_dict().items())
    sd.set_model_state_dict(other, state, options=full)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_foreach_lists_keep_torch_entries():
    from torch.optim import optimizer
    from torch.utils import _foreach_utils
    for types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        assert types.count(globaltensor.GlobalTensor) == 1
        assert torch.Tensor in types   # torch's entries kept


def test_torch_save_of_plain_objects_writes_torch_own_bytes(tmp_path):
    obj = {"w": torch.arange(12.0).reshape(3, 4), "view": torch.arange(10)[2:5], "n": 3,
           "nested": [torch.ones(2, dtype=torch.bfloat16), {"s": "x"}]}
    ours, theirs = io.BytesIO(), io.BytesIO()
    torch.save(obj, ours)
    torch.save.__wrapped__(obj, theirs)
    assert ours.getvalue() == theirs.getvalue()
    assert torch.serialization.save is torch.save
    (tmp_path / "ours").mkdir(), (tmp_path / "theirs").mkdir()
    torch.save(obj, tmp_path / "ours" / "a.pt")
    torch.save.__wrapped__(obj, tmp_path / "theirs" / "a.pt")
    assert (tmp_path / "ours" / "a.pt").read_bytes() == (tmp_path / "theirs" / "a.pt").read_bytes()


def test_rng_state_of_torch_is_torch_own():
    torch.manual_seed(11)
    ours = torch.get_rng_state()
    theirs = torch.default_generator.get_state()   # what torch.get_rng_state returns
    assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype
    assert torch.random.get_rng_state is torch.get_rng_state
    expected = torch.rand(5)
    torch.rand(7)
    torch.set_rng_state(ours)
    assert torch.equal(torch.rand(5), expected)
    torch.set_rng_state(theirs.clone())   # a plain state tensor (no draw number on it)
    assert torch.equal(torch.rand(5), expected)
