"""``to_global`` pins (``planner/pins.py``) in a program that calls its modules one by
one: a step begins at each outermost forward of a module, so a pin's forward is noted
in one recording and its backward, after the last module, runs in another. The
backward must not take the pin's call for one of its own recording (it did: planning
failed, "cannot box a tensor of shape (16, 1024) to shape (16, 10)", and the step ran
op by op, as examples/alexnet_hybrid.py's head did). In a world of 2."""
from __future__ import annotations

import logging

from mp import world_test


def check_a_pin_recorded_before_its_backwards_step_is_left_out():
    import torch

    import globaltensor as gt
    from globaltensor.planner import record
    P, S, B = gt.placement.all("cpu"), gt.sbp.split, gt.sbp.broadcast
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
    plain = [torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)]
    for p, q in zip((*plain[0].parameters(), *plain[1].parameters()),
                    (*fc1.parameters(), *fc2.parameters())):
        p.data.copy_(q.data)
    gt.nn.to_global(fc1, P, lambda name, t: S(0))   # by output features
    gt.nn.to_global(fc2, P, B)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    warned = []
    handler = logging.Handler()
    handler.emit = lambda entry: warned.append(entry.getMessage())
    logging.getLogger("globaltensor").addHandler(handler)
    try:
        for step in range(record.RECORD_AT + 3):
            # each module's outermost forward begins a step (fc1's, then fc2's); the
            # pin gathers fc1's split features before fc2, noted in fc1's recording
            h = fc1(gt.tensor(x, placement=P, sbp=B)).relu().to_global(sbp=B)
            loss = torch.nn.functional.cross_entropy(fc2(h), gt.tensor(y, placement=P, sbp=B))
            loss.backward()
            for m in (fc1, fc2):
                for p in m.parameters():
                    p.data.sub_(0.1 * p.grad)
                    p.grad = None
            want = torch.nn.functional.cross_entropy(plain[1](plain[0](x).relu()), y)
            want.backward()
            for m in plain:
                for p in m.parameters():
                    p.data.sub_(0.1 * p.grad)
                    p.grad = None
            torch.testing.assert_close(loss.full(), want.detach(), rtol=1e-5, atol=1e-6)
    finally:
        logging.getLogger("globaltensor").removeHandler(handler)
    assert not [w for w in warned if "could not be planned" in w], warned
    assert record.state.last is not None   # a step was planned


test_world2 = world_test(__name__, 2, ["check_a_pin_recorded_before_its_backwards_step_is_left_out"])
