"""torch's recurrent layers and cells with a split batch (gt.nn.recurrent): forward
runs on each rank's samples with no communication, outputs and states stay split on the
batch, backward communicates only the weights' gradient sum, and values, input and
weight gradients equal one process; given states of other layouts, a cell stepped over
time, training steps, a 2-D placement, and layouts left to dispatch (split weights,
dropout between layers) give one process's values too.
"""
from __future__ import annotations

import copy

import torch
from mp import checks_in_worlds

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
TOL = dict(atol=1e-5, rtol=1e-5)

# (name, module, input shape, batch dim of the input)
MODULES = [
    ("lstm", lambda: torch.nn.LSTM(5, 7, num_layers=2, bidirectional=True), (6, 5, 5), 1),
    ("lstm_proj_batch_first", lambda: torch.nn.LSTM(5, 7, proj_size=3, batch_first=True), (5, 6, 5), 0),
    ("gru", lambda: torch.nn.GRU(5, 7, num_layers=2, dropout=0.5).eval(), (6, 5, 5), 1),
    ("rnn_batch_first", lambda: torch.nn.RNN(5, 7, batch_first=True, nonlinearity="relu"), (5, 6, 5), 0),
    ("lstm_cell", lambda: torch.nn.LSTMCell(5, 7), (5, 5), 0),
    ("gru_cell", lambda: torch.nn.GRUCell(5, 7), (5, 5), 0),
    ("rnn_cell", lambda: torch.nn.RNNCell(5, 7), (5, 5), 0),
]


def _line():
    return gt.placement("cpu", list(range(gt.get_world_size())))


def _close(got, want, what):
    got = got.full() if isinstance(got, gt.GlobalTensor) else got
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **TOL)


def _flat(out) -> list:
    """The tensors of a recurrent module's output: (output, h) or (output, (h, c)) or h or (h, c)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _against_one_process(make, shape, dim, P, sbp, states=None, state_sbp=None):
    """Run ``make()`` on one process and made global on ``P`` with the input in ``sbp``;
    compare outputs and gradients; return (the global outputs, forward's and backward's
    communication)."""
    torch.manual_seed(0)
    ref = make()
    model = gt.nn.to_global(copy.deepcopy(ref), P, (B,) * len(sbp))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    want_states = None if states is None else tuple(s.clone().requires_grad_() for s in states)
    xr = x.clone().requires_grad_()
    want = _flat(ref(xr, None if states is None else
                     (want_states if len(states) == 2 else want_states[0])))
    weights = [torch.randn(w.shape, generator=gen) for w in want]
    sum(((w * o).sum() for w, o in zip(weights, want))).backward()

    xg = gt.tensor(x, placement=P, sbp=sbp).requires_grad_()
    got_states = None if states is None else tuple(
        gt.tensor(s, placement=P, sbp=state_sbp).requires_grad_() for s in states)
    with gt.debug.comm_stats() as forward:
        got = _flat(model(xg, None if states is None else
                          (got_states if len(states) == 2 else got_states[0])))
    with gt.debug.comm_stats() as backward:
        loss = sum(((gt.tensor(w, placement=P, sbp=g.sbp) * g).sum() for w, g in zip(weights, got)))
        loss.backward()
    for k, (g, w) in enumerate(zip(got, want)):
        _close(g, w.detach(), f"output {k}")
    _close(xg.grad, xr.grad, "input gradient")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.grad, q.grad, f"gradient of {name}")
    for k, (s, r) in enumerate(zip(got_states or (), want_states or ())):
        _close(s.grad, r.grad, f"gradient of given state {k}")
    return got, forward, backward


def check_recurrent_layers_on_a_split_batch_run_on_each_ranks_samples():
    P = _line()
    for name, make, shape, dim in MODULES:
        got, forward, backward = _against_one_process(make, shape, dim, P, (S(dim),))
        assert forward.total_calls == 0, (name, forward)
        # the loss's reduction and the weights' gradient sum; the batch is never gathered
        assert set(backward.calls) == {"all_reduce"}, (name, backward)
        output_dim = dim if len(got[0].shape) == len(shape) else 0
        assert got[0].sbp == (S(output_dim),), (name, got[0].sbp)
        for state in got[1:]:
            assert state.sbp == (S(1 if state.dim() == 3 else 0),), (name, state.sbp)


def check_given_states_and_a_cell_stepped_over_time():
    P = _line()
    h0, c0 = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    # a broadcast initial state is sliced to the batch's split (no communication)
    _, forward, _ = _against_one_process(lambda: torch.nn.GRU(5, 7, num_layers=2), (6, 5, 5), 1,
                                         P, (S(1),), states=(h0,), state_sbp=B)
    assert forward.total_calls == 0, forward
    _against_one_process(lambda: torch.nn.LSTM(5, 7, num_layers=2), (6, 5, 5), 1, P, (S(1),),
                         states=(h0, c0), state_sbp=S(1))
    _against_one_process(lambda: torch.nn.LSTMCell(5, 7), (5, 5), 0, P, (S(0),),
                         states=(h0[0], c0[0]), state_sbp=S(1))

    torch.manual_seed(2)
    ref = torch.nn.LSTMCell(5, 7)
    cell = gt.nn.to_global(copy.deepcopy(ref), P, B)
    xs = torch.randn(4, 5, 5)
    state, got_state = None, None
    with gt.debug.comm_stats() as forward:
        for t in range(4):
            state = ref(xs[t], state)
            got_state = cell(gt.tensor(xs[t], placement=P, sbp=S(0)), got_state)
    assert forward.total_calls == 0, forward
    (state[0].square().sum() + state[1].sum()).backward()
    (got_state[0].square().sum() + got_state[1].sum()).backward()
    _close(got_state[0], state[0].detach(), "h after 4 steps")
    for (name, p), q in zip(cell.named_parameters(), ref.parameters()):
        _close(p.grad, q.grad, f"gradient of {name} after 4 steps")


class _Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.lstm = torch.nn.LSTM(6, 8, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.lstm(self.embed(ids))[0])


def check_a_sequence_model_trains_equal_to_one_process():
    P = _line()
    torch.manual_seed(4)
    ref = _Tagger()
    model = gt.nn.to_global(copy.deepcopy(ref), P, B)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        ids, labels = torch.randint(11, (5, 4), generator=gen), torch.randint(3, (5, 4), generator=gen)
        want = torch.nn.functional.cross_entropy(ref(ids).flatten(0, 1), labels.flatten())
        got = torch.nn.functional.cross_entropy(
            model(gt.tensor(ids, placement=P, sbp=S(0))).flatten(0, 1),
            gt.tensor(labels, placement=P, sbp=S(0)).flatten())
        _close(got, want.detach(), f"loss of step {step}")
        for o, loss in ((opt_ref, want), (opt, got)):
            o.zero_grad()
            loss.backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p, q.detach(), f"{name} after 3 steps")


class _Packed(torch.nn.Module):
    """Sequences of different lengths, packed, as a model's forward packs them."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(5, 7, batch_first=True)
        self.head = torch.nn.Linear(7, 2)

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return self.head(pad_packed_sequence(self.lstm(packed)[0], batch_first=True)[0])


def _packed_against_one_process(P):
    torch.manual_seed(6)
    ref = _Packed()
    model = gt.nn.to_global(copy.deepcopy(ref), P, B)
    x, lengths = torch.randn(5, 6, 5), torch.tensor([6, 3, 5, 2, 4])
    want = ref(x, lengths)
    got = model(gt.tensor(x, placement=P, sbp=S(0)), lengths)
    want.square().sum().backward()
    got.square().sum().backward()
    if gt.get_rank() in P:
        _close(got.to_global(sbp=B).to_local(), want.detach(), "packed output")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            _close(p.grad.to_global(sbp=B).to_local(), q.grad, f"gradient of {name}")


def check_packed_sequences_give_one_process_values():
    # pack_padded_sequence's op failed on meta lengths ("'lengths' argument should be a
    # 1D CPU int64 tensor"); it runs on the whole batch now, and the layer after it too
    _packed_against_one_process(_line())


def check_packed_sequences_on_part_of_the_world():
    # ranks 0 and 3 hold nothing: they take the packed batch's sizes from the lengths
    _packed_against_one_process(gt.placement("cpu", [1, 2]))


def check_layouts_left_to_dispatch_give_one_process_values():
    P = _line()
    # weights split (not a batch's layer any more): dispatch, gathering
    torch.manual_seed(0)
    ref = torch.nn.LSTM(5, 8)
    model = gt.nn.to_global(copy.deepcopy(ref), P, S(0))
    x = torch.randn(6, 5, 5)
    _close(model(gt.tensor(x, placement=P, sbp=S(1)))[0], ref(x)[0].detach(), "split weights")
    # dropout between layers while training: each rank's generator would draw the mask
    model = gt.nn.to_global(torch.nn.GRU(5, 7, num_layers=2, dropout=0.5), P, B)
    with gt.debug.comm_stats() as forward:
        out = model(gt.tensor(x, placement=P, sbp=S(1)))[0]
    assert out.shape == (6, 5, 7) and forward.calls["all_gather"] > 0, forward


def check_a_two_d_placement_runs_on_the_data_axis():
    mesh = gt.placement("cpu", [[0, 1], [2, 3]])
    got, forward, backward = _against_one_process(
        lambda: torch.nn.LSTM(5, 7, num_layers=2), (6, 5, 5), 1, mesh, (S(1), B))
    assert forward.total_calls == 0 and set(backward.calls) == {"all_reduce"}, (forward, backward)
    assert got[0].sbp == (S(1), B), got[0].sbp


def check_ranks_outside_the_placement_get_the_members_layouts():
    # every rank calls the layer (as a pipeline's first run of each stage does); ranks
    # 0 and 3 hold nothing and run it on no samples
    P = gt.placement("cpu", [1, 2])
    inside = gt.get_rank() in P
    for name, make, shape, dim in MODULES:
        torch.manual_seed(0)
        ref = make()
        model = gt.nn.to_global(copy.deepcopy(ref), P, B)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        xg = gt.tensor(x, placement=P, sbp=S(dim)).requires_grad_()
        with gt.debug.comm_stats() as forward:
            got = _flat(model(xg))
        assert forward.total_calls == 0, (name, forward)
        want = _flat(ref(x))
        for k, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.sbp[0] in (S(0), S(1)), (name, k, g.shape, g.sbp)
        sum(g.sum() for g in got).backward()
        sum(w.sum() for w in want).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad is not None and p.grad.sbp == (B,), (name, p.grad)
            if inside:
                _close(p.grad.to_local(), q.grad, f"{name}: a weight's gradient")
        if inside:
            for k, (g, w) in enumerate(zip(got, want)):
                _close(g.to_global(sbp=B).to_local(), w.detach(), f"{name}: output {k}")


CHECKS = ["check_recurrent_layers_on_a_split_batch_run_on_each_ranks_samples",
          "check_given_states_and_a_cell_stepped_over_time",
          "check_a_sequence_model_trains_equal_to_one_process",
          "check_layouts_left_to_dispatch_give_one_process_values",
          "check_packed_sequences_give_one_process_values"]
test_world2, test_world4 = checks_in_worlds(
    __name__, CHECKS, only_in_4=["check_a_two_d_placement_runs_on_the_data_axis",
                                 "check_ranks_outside_the_placement_get_the_members_layouts",
                                 "check_packed_sequences_on_part_of_the_world"])
