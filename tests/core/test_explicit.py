"""Explicit mode (``gt.explicit()``): an op that would box raises ``LayoutError`` naming
the boxing before anything is sent; boxings the program writes run; partial results
flow (or raise with ``allow_partial=False``); backward, the library's own boxings and
whole-step planning keep to it."""
from __future__ import annotations

import pytest
from mp import world_test

import globaltensor as gt


def test_explicit_is_a_context_manager_and_a_decorator():
    from globaltensor import explicit_mode as ex
    assert not ex.active()
    with gt.explicit():
        assert ex.active() and ex.allows_partial()
        with gt.explicit(allow_partial=False):
            assert not ex.allows_partial()
        assert ex.allows_partial()
    assert not ex.active()

    @gt.explicit
    def f(x):
        return ex.active(), x

    @gt.explicit(allow_partial=False)
    def g():
        return ex.allows_partial()
    assert f(3) == (True, 3) and f.__name__ == "f" and g() is False and not ex.active()

    @gt.explicit
    def down(n):   # one decorated function entered again inside itself
        return ex.active() if n == 0 else down(n - 1)
    assert down(3) and not ex.active() and not ex._lines
    with pytest.raises(ValueError):
        with gt.explicit():
            raise ValueError("inside")
    assert not ex.active()
    with pytest.raises(TypeError, match="allow_partial is a keyword"):
        gt.explicit(False)
    assert issubclass(gt.LayoutError, ValueError)   # the API's contract


def _setup():
    import torch
    P = gt.placement.all("cpu")
    torch.manual_seed(0)
    return torch, P


def check_an_op_that_would_box_raises_before_sending():
    torch, P = _setup()
    x = gt.randn(8, 4, placement=P, sbp=gt.sbp.split(0))
    w = gt.randn(4, 6, placement=P, sbp=gt.sbp.broadcast)
    v = gt.randn(6, 3, placement=P, sbp=gt.sbp.split(0))
    with gt.explicit():
        y = x @ w                                  # no boxing: runs
        with gt.debug.comm_stats() as stats:
            with pytest.raises(gt.LayoutError) as caught:
                y @ v                              # v would be gathered
        assert stats.total_calls == 0, stats
        with gt.debug.comm_stats() as written:
            z = y @ v.to_global(sbp=gt.sbp.broadcast)  # written: runs
    message = str(caught.value)
    # the bytes named are those the written boxing sends, as comm_stats counts them
    for part in ("aten.mm.default", "test_explicit.py:", "operand 1: (6, 3)", "split(dim=0) -> broadcast",
                 "AllGather", f"{written.total_bytes} B per rank", ".to_global(sbp=broadcast)"):
        assert part in message, (part, message)
    ref = y.full() @ v.full()
    torch.testing.assert_close(z.full(), ref)


def check_a_partial_scalar_flows_and_trains_equal():
    # data parallel: the loss stays partial inside the region (no reduction at once);
    # backward inside it reduces only the parameters' gradients (their own layouts)
    torch, P = _setup()
    full_x, full_w = torch.randn(8, 4), torch.randn(4, 3)
    grads, losses = [], []
    for explicit in (False, True):
        x = gt.to_global(full_x, P, gt.sbp.broadcast).to_global(sbp=gt.sbp.split(0))
        w = gt.to_global(full_w.clone(), P, gt.sbp.broadcast).requires_grad_()
        with gt.explicit() if explicit else _nothing():
            loss = (x @ w).tanh().sum()
            assert loss.sbp == ((gt.sbp.partial_sum,) if explicit else (gt.sbp.broadcast,))
            loss.backward()
            value = loss.to_global(sbp=gt.sbp.broadcast).item()
        losses.append(value)
        grads.append(w.grad.full())
        assert w.grad.sbp == (gt.sbp.broadcast,)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1])
    ref_w = full_w.clone().requires_grad_()
    (full_x @ ref_w).tanh().sum().backward()
    torch.testing.assert_close(grads[1], ref_w.grad, rtol=1e-5, atol=1e-6)


def check_allow_partial_false_raises_where_an_op_makes_a_partial():
    torch, P = _setup()
    x = gt.randn(8, 4, placement=P, sbp=gt.sbp.split(0))
    with gt.explicit(allow_partial=False):
        with pytest.raises(gt.LayoutError, match="makes a partial result"):
            x.sum()
        # a partial the program made itself flows
        p = gt.to_global(torch.ones(3), P, gt.sbp.partial_sum)
        assert (p * 2).sbp == (gt.sbp.partial_sum,)


def check_megatron_block_with_its_boxings_written_trains_equal():
    # forward in the region: without the written all-reduce the residual add makes x an
    # addend locally and the square of the partial sum raises; with it, values and
    # gradients equal implicit mode's (backward outside)
    import torch.nn.functional as F
    torch, P = _setup()
    full = [torch.randn(8, 16), torch.randn(32, 16) * 0.1, torch.randn(16, 32) * 0.1]
    B, S0, S1 = gt.sbp.broadcast, gt.sbp.split(0), gt.sbp.split(1)

    def block(x, w1, w2, written: bool):
        h = F.linear(x, w1).relu()                # w1 split(0): h split(1), no boxing
        out = F.linear(h, w2)                     # w2 split(1): out partial_sum
        if written:
            out = out.to_global(sbp=B)            # Megatron's all-reduce, written
        return x + out

    results = []
    for mode in ("implicit", "explicit", "explicit, unwritten"):
        x = gt.to_global(full[0], P, B)
        w1 = gt.to_global(full[1], P, B).to_global(sbp=S0).detach().requires_grad_()
        w2 = gt.to_global(full[2], P, B).to_global(sbp=S1).detach().requires_grad_()
        if mode == "explicit, unwritten":
            with gt.explicit():
                y = block(x, w1, w2, written=False)   # x made an addend locally: runs
                assert y.sbp == (gt.sbp.partial_sum,), y.sbp
                with pytest.raises(gt.LayoutError) as caught:
                    y * y                                 # a product of partials: raises
            assert "aten.mul.Tensor" in str(caught.value), str(caught.value)
            assert "partial_sum ->" in str(caught.value), str(caught.value)
            continue
        with gt.explicit() if mode == "explicit" else _nothing():
            y = block(x, w1, w2, written=mode == "explicit")
        (y * y).sum().backward()
        results.append([y.full(), w1.grad.full(), w2.grad.full()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def check_backward_boxing_names_its_autograd_node():
    torch, P = _setup()
    a = gt.randn(8, 4, placement=P, sbp=gt.sbp.split(0), requires_grad=True)
    w = gt.randn(4, 6, placement=P, sbp=gt.sbp.split(1), requires_grad=True)
    loss = ((a @ w) ** 2).sum()                  # forward outside the region
    with gt.explicit(), pytest.raises(gt.LayoutError) as caught:
        loss.backward()
    assert "in backward (MmBackward0" in str(caught.value), str(caught.value)
    with torch.autograd.set_detect_anomaly(True):
        y = a @ w                                 # the forward line named below
        loss = (y ** 2).sum()
        with gt.explicit(), pytest.raises(gt.LayoutError) as caught:
            loss.backward()
    assert "forward at " in str(caught.value) and "test_explicit.py" in str(caught.value)
    # a forward run in the region: each node keeps the program's line, which a boxing
    # of its backward is named at (without anomaly detection)
    from globaltensor import explicit_mode
    x = gt.randn(8, 4, placement=P, sbp=gt.sbp.split(0), requires_grad=True)
    with gt.explicit():
        z = (x * 2).sum(0)                        # this line
    line = z.grad_fn.metadata[explicit_mode._LINE]
    assert line.endswith(f"test_explicit.py:{_line_of('(x * 2).sum(0)')}"), line


def _line_of(text: str) -> int:
    """The first line of this file holding ``text``."""
    from pathlib import Path
    lines = Path(__file__).read_text().splitlines()
    found = [k + 1 for k, line in enumerate(lines) if text in line]
    return found[0]


def check_a_planned_step_in_the_region_boxes_only_where_the_program_does():
    # a function step (no module) run often enough to be recorded and replayed: every
    # step sends what the first sends, and none raises
    torch, P = _setup()
    x = gt.randn(8, 4, placement=P, sbp=gt.sbp.split(0))
    w = gt.randn(4, 4, placement=P, sbp=gt.sbp.broadcast, requires_grad=True)
    sent = []
    for _ in range(9):
        with gt.explicit(), gt.debug.comm_stats() as stats:
            y = (x @ w).relu() @ w
            y.sum().backward()
        sent.append(stats.total_calls)
        w.grad = None
    assert len(set(sent)) == 1, sent


def check_the_librarys_own_boxing_inside_an_op_raises_too():
    # softmax over the split dim gathers inside its decomposition: not the program's
    torch, P = _setup()
    x = gt.randn(4, 8, placement=P, sbp=gt.sbp.split(1))
    with gt.explicit(), gt.debug.comm_stats() as stats:
        with pytest.raises(gt.LayoutError, match="would box"):
            x.softmax(1)
        y = x.to_global(sbp=gt.sbp.split(0)).softmax(1)   # written: the dim made local
    assert stats.calls == {"all_to_all": 1}, stats
    torch.testing.assert_close(y.full(), x.full().softmax(1))


def check_nanogpt_tensor_parallel_raises_then_trains_equal_with_its_boxings_written():
    # benchmarks/tp.py's GPT with Megatron's layout: in the region it raises at the
    # first implicit boxing; with Megatron's to_global calls written in (tp.py's pins)
    # it runs, and trains equal to implicit mode (forward in the region)
    import copy

    from mp import benchmark_module
    torch, P = _setup()
    tp = benchmark_module("tp")
    base = tp.GPT(tp.Config(64, 16, 32, 4, 2))
    B = gt.sbp.broadcast
    pins = {"stream": B, "heads": gt.sbp.split(1), "features": gt.sbp.split(2)}
    ids, targets = (gt.tensor(torch.randint(64, (4, 16)), placement=P, sbp=B) for _ in range(2))
    runs = []
    for mode in ("implicit", "explicit"):
        model = gt.nn.to_global(copy.deepcopy(base), P, lambda name, t: tp._megatron_sbp(name))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if mode == "explicit":
            with gt.explicit(), pytest.raises(gt.LayoutError) as caught:
                model(ids, targets)            # nothing written: the first boxing raises
            assert "native_layer_norm" in str(caught.value) and "tp.py:" in str(caught.value)
        losses = []
        for _ in range(2):
            with gt.explicit() if mode == "explicit" else _nothing():
                loss = model(ids, targets, pins)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs.append((losses, [p.detach().full() for p in model.parameters()]))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-6), runs
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b)


def check_compiled_code_raises_while_tracing():
    torch, P = _setup()
    y = gt.randn(8, 6, placement=P, sbp=gt.sbp.split(0))
    v = gt.randn(6, 3, placement=P, sbp=gt.sbp.split(0))
    f = torch.compile(lambda y, v: y @ v, fullgraph=True, backend="eager")
    with gt.explicit(), pytest.raises(Exception, match="would box 1 operand") as caught:
        f(y, v)
    assert "LayoutError" in str(caught.value) or isinstance(caught.value, gt.LayoutError)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


test_world2 = world_test(__name__, 2, [
    "check_an_op_that_would_box_raises_before_sending",
    "check_a_partial_scalar_flows_and_trains_equal",
    "check_allow_partial_false_raises_where_an_op_makes_a_partial",
    "check_megatron_block_with_its_boxings_written_trains_equal",
    "check_backward_boxing_names_its_autograd_node",
    "check_a_planned_step_in_the_region_boxes_only_where_the_program_does",
    "check_compiled_code_raises_while_tracing",
    "check_the_librarys_own_boxing_inside_an_op_raises_too",
    "check_nanogpt_tensor_parallel_raises_then_trains_equal_with_its_boxings_written",
], in_processes=["check_backward_boxing_names_its_autograd_node",   # anomaly mode: the process's
                 "check_compiled_code_raises_while_tracing"])        # compile's caches: the process's
