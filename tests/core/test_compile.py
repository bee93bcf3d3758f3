"""torch.compile over GlobalTensors on 2 ranks: a traceable subclass.

``fullgraph=True`` traces data- and tensor-parallel MLPs forward and backward into graphs
of local aten ops and functional collectives (checked op by op), with "aot_eager" and
"inductor"; values, gradients and parameters after optimizer steps equal eager; the
graph is compiled once for every step. Code that moves between placements inside a
compiled function breaks the graph there and still gives the eager values. A compiled
train step with ``loss.backward()`` inside breaks the graph at backward, as for plain
tensors (also checked in this process, a world of one). A rank holding an empty part
compiles the same collectives, in the same graphs, as the others.
"""
from __future__ import annotations

from mp import world_test


def _mlp(tensor_parallel: bool):
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if not tensor_parallel:
        return gt.nn.to_global(m, P, gt.sbp.broadcast)
    megatron = {"0.weight": gt.sbp.split(0), "0.bias": gt.sbp.split(0),
                "2.weight": gt.sbp.split(1), "2.bias": gt.sbp.broadcast}
    return gt.nn.to_global(m, P, lambda name, t: megatron[name])


_ALLOWED_NAMESPACES = ("aten", "_c10d_functional", "prims")


def _graph_ops(graphs) -> set:
    """The namespaces of every call in the traced forward and backward graphs."""
    import torch
    seen = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function":
                target = node.target
                assert isinstance(target, torch._ops.OpOverload), \
                    f"a Python call in the compiled graph: {target}"
                seen.add(target.namespace)
    return seen


def _recording_backend(graphs: list):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def _train_fullgraph(tensor_parallel: bool, backend: str) -> None:
    import torch
    import torch._dynamo.testing
    import torch.nn.functional as F

    import globaltensor as gt
    from globaltensor.planner import record as step
    step.clear()
    P = gt.placement.all("cpu")
    data_sbp = gt.sbp.broadcast if tensor_parallel else gt.sbp.split(0)
    graphs: list = []
    compiler = _recording_backend(graphs) if backend == "graphs" else backend
    counter = torch._dynamo.testing.CompileCounterWithBackend(compiler)
    torch._dynamo.reset()
    loss_of = torch.compile(lambda m, x, y: F.cross_entropy(m(x), y), backend=counter,
                            fullgraph=True)
    eager, compiled = _mlp(tensor_parallel), _mlp(tensor_parallel)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = gt.tensor(torch.randn(6, 8, generator=g), placement=P, sbp=data_sbp)
        y = gt.tensor(torch.randint(0, 4, (6,), generator=g), placement=P, sbp=data_sbp)
        a = F.cross_entropy(eager(x), y)
        b = loss_of(compiled, x, y)
        a.backward()
        b.backward()
        torch.testing.assert_close(b.full(), a.full())
        for pa, pb in zip(eager.parameters(), compiled.parameters()):
            assert pb.grad.sbp == pa.grad.sbp == pa.sbp, (pb.grad.sbp, pa.grad.sbp)
            torch.testing.assert_close(pb.grad.full(), pa.grad.full())
        opt_e.step()
        opt_c.step()
        opt_e.zero_grad()
        opt_c.zero_grad()
    for pa, pb in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(pb.full(), pa.full())
    # once, and once more if the plan made from the first trace beats it (traced.py)
    assert counter.frame_count == 1 + bool(step.state.plans), \
        f"compiled {counter.frame_count} times in 3 steps"
    step.clear()
    if graphs:
        assert len(graphs) == 2 * counter.frame_count  # one forward, one backward each
        assert _graph_ops(graphs) <= set(_ALLOWED_NAMESPACES), _graph_ops(graphs)
        if tensor_parallel:  # the row-parallel layer's partial sum is reduced in the graph
            assert "_c10d_functional" in _graph_ops(graphs)


def check_data_parallel_mlp_graphs_hold_only_local_ops():
    _train_fullgraph(False, "graphs")


def check_tensor_parallel_mlp_graphs_hold_local_ops_and_collectives():
    _train_fullgraph(True, "graphs")


def check_data_parallel_mlp_inductor():
    _train_fullgraph(False, "inductor")


def check_tensor_parallel_mlp_inductor():
    _train_fullgraph(True, "inductor")
    # Compiled again after dynamo.reset: torch's on-disk caches now answer, and a
    # graph traced on one rank (its part offsets) must not serve the other.
    _train_fullgraph(True, "inductor")


def check_to_global_within_a_placement_is_traced():
    # A same-placement to_global, and the cross-rank softmax decomposition, in one graph;
    # gradients through both.
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")

    def f(x):
        return (torch.softmax(x, 0) + x.to_global(sbp=gt.sbp.broadcast) * 2).sum()

    torch._dynamo.reset()
    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    plain = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (f, g):
        x = gt.tensor(plain, placement=P, sbp=gt.sbp.split(0), requires_grad=True)
        out = fn(x)
        out.backward()
        grads.append(x.grad.full())
        torch.testing.assert_close(out.full(), (torch.softmax(plain, 0) + plain * 2).sum())
    torch.testing.assert_close(grads[1], grads[0])


def check_traced_boxing_equals_eager():
    # Every same-placement change of sbp, even and uneven, traced (functional
    # collectives: all_gather, all_reduce, all_to_all for reduce-scatter and split->split).
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")
    S = gt.sbp
    kinds = [S.split(0), S.split(1), S.broadcast, S.partial_sum]
    # The reversed placement's group (ranks 1, 0) is first made while tracing (by its
    # members only, named by its ranks, as in eager code).
    for shape, on in (((5, 3), P), ((4, 6), P), ((5, 3), gt.placement("cpu", [1, 0]))):
        plain = torch.randn(shape, generator=torch.Generator().manual_seed(4))
        for src in kinds:
            torch._dynamo.reset()
            f = torch.compile(lambda x: [x.to_global(sbp=dst) * 2 for dst in kinds],
                              backend="aot_eager", fullgraph=True)
            for dst, y in zip(kinds, f(gt.tensor(plain, placement=on, sbp=src))):
                assert y.sbp == (dst,), (src, dst, y.sbp)
                torch.testing.assert_close(y.full(), plain * 2, msg=lambda m: f"{src}->{dst}: {m}")


def check_to_global_across_placements_breaks_the_graph():
    import torch
    import torch._dynamo.testing

    import globaltensor as gt
    P0, P1 = gt.placement("cpu", [0]), gt.placement("cpu", [1])

    def f(x):
        return (x.to_global(P1, gt.sbp.broadcast) * 2).sum()

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    plain = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    x = gt.tensor(plain, placement=P0, sbp=gt.sbp.broadcast)
    out = torch.compile(f, backend=counter)(x)
    torch.testing.assert_close(out.full(), (plain * 2).sum())
    assert out.placement == P1

    # backward inside the compiled function: the engine runs to_global's backward (a
    # transfer back to P0) eagerly, which dynamo compiled when its frames were not
    # skipped ("a point-to-point transfer cannot be traced")
    def train(x):
        out = f(x)
        out.backward()
        return out

    grads = []
    for fn in (train, torch.compile(train, backend="aot_eager")):
        torch._dynamo.reset()
        x = gt.tensor(plain, placement=P0, sbp=gt.sbp.broadcast, requires_grad=True)
        torch.testing.assert_close(fn(x).full(), (plain * 2).sum())
        assert x.grad.placement == P0
        grads.append(x.grad.full())
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[1], torch.full_like(plain, 2.0))


def check_rank_outside_the_placement_compiles():
    # Rank 1 holds no part: its compiled calls give empty parts, also for a view
    # (a micro-batch slice) whose empty part is no view of its base's.
    import torch

    import globaltensor as gt
    P0 = gt.placement("cpu", [0])
    x = gt.tensor(torch.ones(16, 3), placement=P0, sbp=gt.sbp.broadcast)
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2).sum(1), backend="aot_eager", fullgraph=True)
    for t in (x, x[0:4]):
        y = f(t)
        assert y.shape == (t.shape[0],) and y.placement == P0
        torch.testing.assert_close(y.full(), torch.full((t.shape[0],), 6.0))


def check_pipeline_of_compiled_stages_equals_eager():
    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    P0, P1 = gt.placement("cpu", [0]), gt.placement("cpu", [1])

    def stages():
        torch.manual_seed(0)
        s0 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        s1 = torch.nn.Linear(32, 4)
        return gt.nn.to_global(s0, P0, gt.sbp.broadcast), gt.nn.to_global(s1, P1, gt.sbp.broadcast)

    g = torch.Generator().manual_seed(1)
    x = gt.tensor(torch.randn(16, 16, generator=g), placement=P0, sbp=gt.sbp.broadcast)
    y = gt.tensor(torch.randint(0, 4, (16,), generator=g), placement=P1, sbp=gt.sbp.broadcast)
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        mods = stages()
        if compiled:
            mods = [torch.compile(m, backend="aot_eager", fullgraph=True) for m in mods]
        pipe = gt.pipeline.Pipeline(mods, micro_batches=4, schedule="1f1b",
                                    loss_fn=F.cross_entropy)
        for _ in range(2):
            loss = pipe.step(x, y)
        grads = [p.grad for m in mods for p in m.parameters()]
        results.append((loss, [None if g is None else g.local_part for g in grads]))
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e)
    # this rank's stage's weight and bias (the other stage's .grad is an empty part here)
    assert sum(g is not None and g.numel() > 0 for g in grads_c) == 2
    for a, b in zip(grads_e, grads_c):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a)


def check_compiled_autograd_syncs_gradients():
    # Compiled autograd traces gradient sync's hook: it boxes each gradient at once
    # instead of bucketing (buckets need the engine's end-of-backward callback).
    import torch
    import torch._dynamo.compiled_autograd as compiled_autograd
    import torch.nn.functional as F

    import globaltensor as gt
    P = gt.placement.all("cpu")
    torch._dynamo.reset()
    eager, compiled = _mlp(False), _mlp(False)
    g = torch.Generator().manual_seed(5)
    x = gt.tensor(torch.randn(6, 8, generator=g), placement=P, sbp=gt.sbp.split(0))
    y = gt.tensor(torch.randint(0, 4, (6,), generator=g), placement=P, sbp=gt.sbp.split(0))
    loss_of = torch.compile(lambda m, x, y: F.cross_entropy(m(x), y), backend="aot_eager",
                            fullgraph=True)
    F.cross_entropy(eager(x), y).backward()
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss_of(compiled, x, y).backward()
    for pa, pb in zip(eager.parameters(), compiled.parameters()):
        assert pb.grad.sbp == pa.grad.sbp == pa.sbp, (pb.grad.sbp, pa.sbp)
        torch.testing.assert_close(pb.grad.full(), pa.grad.full())
    # as_strided (which compiled autograd uses on gradients) on a split tensor
    plain = torch.arange(12.0).view(4, 3)
    z = gt.tensor(plain, placement=P, sbp=gt.sbp.split(0))
    torch.testing.assert_close(z.as_strided((3, 4), (4, 1)).full(),
                               plain.as_strided((3, 4), (4, 1)))


def check_recompile_after_reset_keeps_values():
    # Issue 14's reproduction: the second compilation (after dynamo.reset) raised
    # "cannot box a tensor of shape (9, 6) to shape (8, 6)" on 1 and 2 ranks.
    import torch

    import globaltensor as gt

    def f(x):
        return torch.softmax(x, 0) + x.to_global(sbp=gt.sbp.broadcast) * 2

    for placement in (gt.placement("cpu", [0]), gt.placement.all("cpu")):
        for _ in range(2):
            torch._dynamo.reset()
            g = torch.compile(f, backend="eager")
            for rows in (8, 9, 10, 12, 7):
                plain = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows))
                x = gt.tensor(plain, placement=placement, sbp=gt.sbp.split(0))
                torch.testing.assert_close(g(x).full(), torch.softmax(plain, 0) + plain * 2)



def _tiny_gpt(vocab_parallel: bool):
    """nanoGPT in miniature: token and position embeddings, two pre-norm blocks
    (causal attention, gelu MLP), a final layer norm, an lm head tied to the token
    embedding, cross entropy. Parameters broadcast, or the token embedding (and so the
    tied head) split by rows."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import globaltensor as gt
    vocab, length, width, heads = 16, 6, 8, 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.c_fc, self.mlp_proj = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
            self.h = nn.ModuleList([Block(), Block()])
            self.ln_f = nn.LayerNorm(width)
            self.lm_head = nn.Linear(width, vocab, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, pos, targets):
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))

    torch.manual_seed(0)
    rows = gt.sbp.split(0) if vocab_parallel else gt.sbp.broadcast
    model = gt.nn.to_global(GPT(), gt.placement.all("cpu"),
                            lambda name, t: rows if name == "wte.weight" else gt.sbp.broadcast)
    return model, vocab, length


def check_gpt_with_embeddings_compiles_whole():
    # F.embedding used to branch on index values ("Could not guard on data-dependent
    # expression"): a model with an embedding did not trace as one graph.
    import torch
    import torch._dynamo.testing

    import globaltensor as gt
    P, S, B = gt.placement.all("cpu"), gt.sbp.split, gt.sbp.broadcast
    for vocab_parallel, data_sbp in ((False, S(0)), (True, B)):
        (eager, vocab, length), (compiled, _, _) = _tiny_gpt(vocab_parallel), \
            _tiny_gpt(vocab_parallel)
        g = torch.Generator().manual_seed(7)
        idx, targets = (gt.tensor(torch.randint(0, vocab, (4, length), generator=g),
                                  placement=P, sbp=data_sbp) for _ in range(2))
        pos = gt.tensor(torch.arange(length), placement=P, sbp=B)
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        loss = torch.compile(compiled, backend=counter, fullgraph=True)(idx, pos, targets)
        want = eager(idx, pos, targets)
        loss.backward()
        want.backward()
        assert counter.frame_count == 1, counter.frame_count
        torch.testing.assert_close(loss.full(), want.full())
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert b.grad.sbp == a.grad.sbp == a.sbp, (name, b.grad.sbp, a.sbp)
            torch.testing.assert_close(b.grad.full(), a.grad.full(), msg=lambda m: f"{name}: {m}")


def check_positions_built_in_forward_compile_whole_without_a_scope():
    """nanoGPT, Hugging Face and torchtitan build positions in the forward with
    ``torch.arange(T, device=idx.device)``: eager takes that plain tensor as broadcast
    inside a global module; compiled, with fullgraph=True and no context manager, too."""
    import torch
    import torch._dynamo.testing

    import globaltensor as gt
    P, S = gt.placement.all("cpu"), gt.sbp.split

    class WithPositions(torch.nn.Module):
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            return self.gpt(idx, pos, targets)

    (eager, vocab, length), (compiled, _, _) = _tiny_gpt(False), _tiny_gpt(False)
    eager, compiled = WithPositions(eager), WithPositions(compiled)
    g = torch.Generator().manual_seed(3)
    idx, targets = (gt.tensor(torch.randint(0, vocab, (4, length), generator=g),
                              placement=P, sbp=S(0)) for _ in range(2))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    loss = torch.compile(compiled, backend=counter, fullgraph=True)(idx, targets)
    want = eager(idx, targets)
    loss.backward()
    want.backward()
    assert counter.frame_count == 1, counter.frame_count
    torch.testing.assert_close(loss.full(), want.full())
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad.full(), a.grad.full(), msg=lambda m: f"{name}: {m}")


def check_data_dependent_ops_break_the_graph():
    # x[mask], nonzero and unique cannot be traced (their output shape depends on the
    # values): dynamo breaks the graph there, as for plain tensors, and they run eagerly.
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")
    plain = torch.arange(12.0).view(4, 3)

    def f(x):
        return (x[x > 4] * 2).sum() + torch.nonzero(x > 4).sum() + torch.unique(x.detach()).sum()

    torch._dynamo.reset()
    x = gt.tensor(plain, placement=P, sbp=gt.sbp.split(0), requires_grad=True)
    out = torch.compile(f, backend="aot_eager")(x)
    out.backward()
    want = plain.clone().requires_grad_()
    f(want).backward()
    torch.testing.assert_close(out.full(), f(plain))
    torch.testing.assert_close(x.grad.full(), want.grad)
    assert x.grad.sbp == x.sbp


def check_a_rank_holding_an_empty_part_compiles_the_same_collectives():
    # x.amin()'s backward splits a (1, 1) count over the ranks: the second holds an
    # empty part and makes its share from nothing. Its graph must still read the
    # backward's input there, or the partitioner moves the all-gather that follows
    # into its forward graph while the first rank runs it in the backward: a hang.
    import torch

    import globaltensor as gt
    plain = torch.arange(48.0).view(8, 6).sin()

    def f(t):
        return t.amin() + t.amin(1).sum()

    torch._dynamo.reset()
    x = gt.tensor(plain, placement=gt.placement.all("cpu"), sbp=gt.sbp.split(0),
                  requires_grad=True)
    out = torch.compile(f)(x)
    out.backward()
    want = plain.clone().requires_grad_()
    f(want).backward()
    torch.testing.assert_close(out.full(), f(plain))
    torch.testing.assert_close(x.grad.full(), want.grad)
    torch._dynamo.reset()


def check_writes_through_views_of_split_dims_compile_as_eager():
    # y[1] = 0 on a tensor split on dim 0 writes through a view of a boxed copy
    # (dispatch/copied_views.py); traced, the write was lost as it was eagerly. Also a
    # write into an input under no_grad, which AOTAutograd applies to the input.
    import torch

    import globaltensor as gt
    p, split = gt.placement.all("cpu"), gt.sbp.split

    def f(w, x):
        y = x * 2
        y[1] = 0
        y[:, 1:3] *= 3
        return (y + w).sum(), y.detach()

    def into_input(w, x):
        with torch.no_grad():
            w[2] = 7
        return w * x

    for fn in (f, into_input):
        torch._dynamo.reset()
        results = []
        for run in (fn, torch.compile(fn)):
            w = gt.ones(5, 4, placement=p, sbp=split(0))
            x = gt.tensor(torch.arange(20.0).view(5, 4), placement=p, sbp=split(0),
                          requires_grad=fn is f)
            out = run(w, x)
            if fn is f:
                out[0].backward()
                results.append((out[1].full(), x.grad.full()))
            else:
                results.append((out.full(), w.full()))
        for got, want in zip(*results[::-1]):
            torch.testing.assert_close(got, want)
    torch._dynamo.reset()


def _train(model, batches: list, compiled: bool) -> tuple:
    """``model`` trained by ``train_step`` (forward, ``loss.backward()``, AdamW's step,
    zero_grad) on ``batches``, compiled or not: (the losses, the parameters after the
    last step, each step's eager collectives by kind)."""
    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if compiled:
        torch._dynamo.reset()
        train_step = torch.compile(train_step, backend="aot_eager")
    losses, collectives = [], []
    for x, y in batches:
        with gt.debug.comm_stats() as stats:
            losses.append(train_step(x, y))
        collectives.append(dict(stats.calls))
    return losses, list(model.parameters()), collectives


def check_compiled_train_step_with_backward_equals_eager():
    # The reproduction: the eager backward inside a compiled train step runs
    # with dynamo's frame callback set, and dynamo compiled our runtime's frames
    # (dispatch from torch.ones_like in autograd's _make_grads: "'GlobalTensor' object
    # has no attribute '_local'"; AOTAutograd's unflatten; gradient sync's hooks, which
    # then reduced each gradient on its own). As for plain tensors, the graph breaks at
    # backward; losses and parameters are eager's.
    import torch

    import globaltensor as gt
    from globaltensor.planner import record as step
    P = gt.placement.all("cpu")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    g = torch.Generator().manual_seed(6)
    plain = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
             for _ in range(5)]
    batches = [tuple(gt.tensor(t, placement=P, sbp=gt.sbp.split(0)) for t in b) for b in plain]
    want, want_params, _ = _train(mlp(), plain, False)
    results = []
    for compiled in (False, True):
        step.clear()  # each run plans its own steps, as a fresh program would
        results.append(_train(gt.nn.to_global(mlp(), P, gt.sbp.broadcast), batches, compiled))
    step.clear()
    torch._dynamo.reset()
    (eager, eager_params, _), (compiled, compiled_params, collectives) = results
    if gt.get_world_size() > 1:
        # Gradient sync stays eager: one bucketed all-reduce of the four gradients
        # (the loss is reduced inside the graph), not one per gradient.
        assert collectives == [{"all_reduce": 1}] * len(batches), collectives
    for a, b, c in zip(want, eager, compiled):
        torch.testing.assert_close(c.full(), b.full())
        torch.testing.assert_close(c.full(), a.detach())
    for a, b, c in zip(want_params, eager_params, compiled_params):
        assert c.sbp == b.sbp == (gt.sbp.broadcast,) and c.grad is None, (c.sbp, c.grad)
        torch.testing.assert_close(c.full(), b.full())
        torch.testing.assert_close(c.full(), a.detach())


def check_fully_shard_compiles_equal_to_eager():
    # fully_shard's hooks run eagerly around the compiled forwards: the biases gathered in
    # a bucket, the weights each alone (their parts padded to the largest and cut out
    # again: rows uneven over the ranks)
    import torch

    import globaltensor as gt
    from globaltensor.nn import shard_comm
    n, P = gt.get_world_size(), gt.placement.all("cpu")

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 2 * n + 1), torch.nn.Tanh(),
                                   torch.nn.Linear(2 * n + 1, 5))
    reference, x = mlp(), torch.randn(4 * n, 6)
    want = reference(x).square().mean()
    want.backward()
    saved = shard_comm.OWN_GATHER_BYTES
    shard_comm.OWN_GATHER_BYTES = 5 * (2 * n + 1) * 4   # the smaller weight's bytes
    try:
        model = gt.nn.fully_shard(mlp(), P)
        compiled = torch.compile(model, backend="aot_eager")
        loss = compiled(gt.tensor(x, placement=P, sbp=gt.sbp.split(0))).square().mean()
        loss.backward()
        torch.testing.assert_close(loss.full(), want.detach())
        for (name, t), w in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(t.grad.full(), w.grad, rtol=1e-5, atol=1e-6)
        torch._dynamo.reset()
    finally:
        shard_comm.OWN_GATHER_BYTES = saved


def check_fully_shard_of_many_units_compiles_each_forward_once():
    # More units than dynamo's recompile limit (8): fully_shard's hooks are not traced.
    # Traced, the gather was compiled again for every unit's parameters until dynamo
    # gave up on it with a warning ("hit config.recompile_limit"), and the compiled steps
    # ran at twice eager's time. Two steps, gradients summed, equal one process's.
    import copy
    import logging

    import torch

    import globaltensor as gt
    n, P = gt.get_world_size(), gt.placement.all("cpu")
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*(m for _ in range(10)
                                      for m in (torch.nn.Linear(4, 4), torch.nn.Tanh())))
    model = gt.nn.fully_shard(copy.deepcopy(reference), P)
    x = torch.randn(2 * n, 4)
    warned: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            loss = compiled(gt.tensor(x, placement=P, sbp=gt.sbp.split(0))).square().mean()
            loss.backward()
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()
    assert not [m for m in warned if "limit" in m], warned
    want = reference(x).square().mean()
    want.backward()
    torch.testing.assert_close(loss.full(), want.detach())
    for t, w in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(t.grad.full(), 2 * w.grad, rtol=1e-5, atol=1e-6)


def check_fully_shard_embeddings_compile_with_static_shapes():
    # Each unit's forward is a frame of its own: nn.Embedding's, called for the tokens
    # and then for the positions, is compiled again with the positions' dim symbolic
    # (dynamo's automatic dynamic shapes), which no layout holds: the trace specializes
    # it (it raised a TypeError asking for dynamic=False), and with the default and
    # with dynamic=False the step equals eager.
    import copy

    import torch

    import globaltensor as gt
    n, P = gt.get_world_size(), gt.placement.all("cpu")

    class Embeddings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(16, 4), torch.nn.Embedding(8, 4)

        def forward(self, ids):
            return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))

    torch.manual_seed(0)
    reference = Embeddings()
    ids = torch.randint(16, (2 * n, 6))
    want = reference(ids).square().mean()
    want.backward()
    for dynamic in (None, False):
        model = gt.nn.fully_shard(copy.deepcopy(reference), P)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", dynamic=dynamic)
        x = gt.tensor(ids, placement=P, sbp=gt.sbp.split(0))
        try:
            with gt.implicit_broadcast():
                loss = compiled(x).square().mean()
            loss.backward()
        finally:
            torch._dynamo.reset()
        torch.testing.assert_close(loss.full(), want.detach())
        for t, w in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(t.grad.full(), w.grad, rtol=1e-5, atol=1e-6)


def check_blocks_compiled_before_to_global_train_as_eager():
    # torch.compile(block) for each block, then to_global of the whole model (the order
    # of a model built with compiled blocks): the scope hooks of the block inside its
    # compiled wrapper are traced, and dynamo failed there ("already tracked for
    # mutation") reading the list of open scopes, which holds the wrapper.
    import copy

    import torch
    import torch.nn.functional as F

    import globaltensor as gt
    P = gt.placement.all("cpu")
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.GELU())
              for _ in range(2)]
    reference = torch.nn.Sequential(*blocks, torch.nn.Linear(8, 3))
    model = copy.deepcopy(reference)
    for i in range(2):
        model[i] = torch.compile(model[i], backend="aot_eager")
    gt.nn.to_global(model, P, gt.sbp.broadcast)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        loss = F.cross_entropy(model(gt.tensor(x, placement=P, sbp=gt.sbp.split(0))),
                               gt.tensor(y, placement=P, sbp=gt.sbp.split(0)))
        loss.backward()
        want = F.cross_entropy(reference(x), y)
        want.backward()
        torch.testing.assert_close(loss.full(), want.detach())
    for t, w in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(t.grad.full(), w.grad, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_compiled_train_step_with_backward_in_one_process():
    check_compiled_train_step_with_backward_equals_eager()


CHECKS = ["check_data_parallel_mlp_graphs_hold_only_local_ops",
          "check_positions_built_in_forward_compile_whole_without_a_scope",
          "check_tensor_parallel_mlp_graphs_hold_local_ops_and_collectives",
          "check_data_parallel_mlp_inductor", "check_tensor_parallel_mlp_inductor",
          "check_to_global_within_a_placement_is_traced", "check_traced_boxing_equals_eager",
          "check_to_global_across_placements_breaks_the_graph",
          "check_rank_outside_the_placement_compiles",
          "check_pipeline_of_compiled_stages_equals_eager",
          "check_compiled_autograd_syncs_gradients",
          "check_recompile_after_reset_keeps_values",
          "check_gpt_with_embeddings_compiles_whole",
          "check_data_dependent_ops_break_the_graph",
          "check_a_rank_holding_an_empty_part_compiles_the_same_collectives",
          "check_writes_through_views_of_split_dims_compile_as_eager",
          "check_compiled_train_step_with_backward_equals_eager",
          "check_fully_shard_compiles_equal_to_eager",
          "check_fully_shard_of_many_units_compiles_each_forward_once",
          "check_fully_shard_embeddings_compile_with_static_shapes",
          "check_blocks_compiled_before_to_global_train_as_eager"]


# torch.compile's caches are the process's: every check runs in a world of processes
test_world2 = world_test(__name__, 2, CHECKS, in_processes=CHECKS)


def test_plain_tensors_built_in_a_graph_that_the_eager_backend_runs_need_the_scope():
    """backend="eager" runs dynamo's graph on the GlobalTensors without tracing it, and
    skips the converted module's scope: a position tensor built in the graph raises the
    plain-operand error unless the call runs in gt.implicit_broadcast(), and then equals
    eager; aot_eager, which traces, takes it without (docs/compile.md)."""
    import copy

    import pytest
    import torch

    import globaltensor as gt
    P = gt.placement.all("cpu")

    class WithPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Embedding(8, 4)

        def forward(self, x):
            return x + self.pos(torch.arange(x.shape[1], device=x.device))

    torch.manual_seed(0)
    plain, x = WithPositions(), torch.randn(2, 6, 4)
    want = plain(x)
    model = gt.nn.to_global(copy.deepcopy(plain), P, gt.sbp.broadcast)
    gx = gt.tensor(x, placement=P, sbp=gt.sbp.split(0))
    try:
        for backend in ("eager", "aot_eager"):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            if backend == "eager":
                with pytest.raises(ValueError, match=r"plain tensor of shape \(6,\).*implicit_broadcast"):
                    compiled(gx)
                with gt.implicit_broadcast():
                    torch.testing.assert_close(compiled(gx).full(), want.detach())
            else:
                torch.testing.assert_close(compiled(gx).full(), want.detach())
    finally:
        torch._dynamo.reset()
