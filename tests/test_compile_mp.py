"""torch.compile over code that uses GlobalTensors: never an error, never a wrong value.
The runtime is hidden from dynamo, so compiled code runs it eagerly (graph breaks)."""
from __future__ import annotations


from mp import world_test


def check_recompile_after_reset_keeps_values():
    # Issue 14's reproduction: the second compilation (after dynamo.reset) raised
    # "cannot box a tensor of shape (9, 6) to shape (8, 6)" on 1 and 2 ranks.
    import torch
    import globaltensor as gt

    def f(x):
        return torch.softmax(x, 0) + x.to_global(sbp=gt.sbp.broadcast) * 2

    for placement in (gt.placement("cpu", [0]), gt.placement.all("cpu")):
        for _ in range(2):
            g = torch.compile(f, backend="eager")
            for rows in (8, 9, 10, 12, 7):
                plain = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows))
                x = gt.tensor(plain, placement=placement, sbp=gt.sbp.split(0))
                torch.testing.assert_close(g(x).full(), torch.softmax(plain, 0) + plain * 2)
            torch._dynamo.reset()


def check_compiled_training_step_equals_eager():
    import torch
    import torch.nn.functional as F
    import globaltensor as gt
    P = gt.placement.all("cpu")

    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        return gt.nn.to_global(m, P, lambda name, t: gt.sbp.split(0) if name.startswith("0.")
                               else gt.sbp.broadcast)

    eager, compiled = make(), make()
    step = torch.compile(lambda m, x, y: F.cross_entropy(m(x), y), backend="aot_eager")
    data = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([0, 1, 2, 0, 1, 2])
    x = gt.tensor(data, placement=P, sbp=gt.sbp.split(0))
    y = gt.tensor(target, placement=P, sbp=gt.sbp.split(0))
    for _ in range(2):
        a = F.cross_entropy(eager(x), y)
        b = step(compiled, x, y)
        a.backward()
        b.backward()
        torch.testing.assert_close(b.full(), a.full())
    for pa, pb in zip(eager.parameters(), compiled.parameters()):
        assert pb.grad.sbp == pa.grad.sbp
        torch.testing.assert_close(pb.grad.full(), pa.grad.full())


CHECKS = ["check_recompile_after_reset_keeps_values", "check_compiled_training_step_equals_eager"]


test_world2 = world_test(__name__, 2, CHECKS)
