"""Softmax and log_softmax over every dim, cross_entropy (vocab-parallel logits, ignore_index,
label smoothing, (N, C, d) inputs), nll_loss, mse_loss, the elementwise losses, and losses torch has no Meta kernel for
(multi_margin_loss's backward, ctc_loss: run on the whole values).

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ops_battery import B, P, S, battery_tests, case, checked, placements, randint, randn


@checked
def check_softmax_and_losses():
    x = randn((5, 4), "sx")
    x3 = randn((2, 3, 4), "sx3")
    for v in (x, x3):
        for d in range(v.dim()):
            case(f"softmax dim {d} of {tuple(v.shape)}", lambda t, d=d: F.softmax(t, dim=d),
                 [v], places=placements(5, 0, 3))
            case(f"log_softmax dim {d} of {tuple(v.shape)}",
                 lambda t, d=d: F.log_softmax(t, dim=d), [v], places=placements(5, 0, 3))
    case("x.softmax(-1)", lambda t: t.softmax(-1), [x], places=placements(4, 1, 0))
    logits, target = randn((5, 7), "logits"), randint(7, (5,), "target")
    ce_choices = [[B, S(0), S(1), P], [B, S(0)]]
    for red in ("mean", "sum", "none"):
        case(f"cross_entropy {red}",
             lambda z, t, red=red: F.cross_entropy(z, t, reduction=red), [logits, target],
             choices=ce_choices, must=[(S(1), B), (S(0), S(0)), (S(1), S(0))],
             places=placements(6, 1, 4))
    ignored = target.clone()
    ignored[2] = -100
    case("cross_entropy ignore_index", lambda z, t: F.cross_entropy(z, t), [logits, ignored],
         choices=ce_choices, must=[(S(1), B)], places=placements(4, 0, 2))
    case("cross_entropy label_smoothing",
         lambda z, t: F.cross_entropy(z, t, label_smoothing=0.1), [logits, target],
         choices=ce_choices, must=[(S(1), B)], places=placements(4, 0, 2))
    logits3, target3 = randn((2, 7, 3), "logits3"), randint(7, (2, 3), "target3")
    case("cross_entropy (N,C,d)", F.cross_entropy, [logits3, target3],
         choices=[[B, S(0), S(1), S(2)], [B, S(0), S(1)]], places=placements(5, 0, 3))
    for red in ("mean", "sum"):
        case(f"nll_loss {red}",
             lambda z, t, red=red: F.nll_loss(F.log_softmax(z, dim=1), t, reduction=red),
             [logits, target], choices=ce_choices, places=placements(6, 0, 3))
    y = randn((5, 4), "sy")
    for red in ("mean", "sum"):
        case(f"mse_loss {red}", lambda a, b, red=red: F.mse_loss(a, b, reduction=red), [x, y],
             places=placements(6, 1, 3))
    others = {"smooth_l1_loss": lambda a, b, red: F.smooth_l1_loss(a, b, reduction=red, beta=0.5),
              "huber_loss": lambda a, b, red: F.huber_loss(a, b, reduction=red, delta=0.7),
              "soft_margin_loss": lambda a, b, red: F.soft_margin_loss(a, b.sign(), reduction=red)}
    for name, loss in others.items():
        for red in ("mean", "sum", "none"):
            case(f"{name} {red}", lambda a, b, loss=loss, red=red: loss(a, b, red), [x, y],
                 nograd=(1,) if name == "soft_margin_loss" else (), places=placements(3, 0, 2))
    # torch has no Meta kernel for these (multi_margin_loss's backward, ctc_loss): they
    # run on the whole values (a FallbackWarning), equal to torch
    classes = randint(4, (5,), "mm_target")
    for red in ("mean", "none"):
        case(f"multi_margin_loss {red}", lambda a, t, red=red: F.multi_margin_loss(a, t, reduction=red),
             [x, classes], choices=[[B, S(0), S(1)], [B, S(0)]], places=placements(3, 0, 2))
    log_probs, targets = randn((7, 5, 4), "ctc_in"), randint(3, (5, 3), "ctc_targets") + 1
    lengths, target_lengths = torch.full((5,), 7), randint(3, (5,), "ctc_lengths") + 1
    case("ctc_loss", lambda lp, t, il, tl: F.ctc_loss(lp.log_softmax(2), t, il, tl),
         [log_probs, targets, lengths, target_lengths],
         choices=[[B, S(1)], [B, S(0)], [B, S(0)], [B, S(0)]], places=placements(3, 0, 2))


@checked
def check_cross_entropy_over_split_rows_checks_targets_once():
    """The mean over split rows is computed as a sum, which comes back to the same
    decomposition: its targets are checked (a collective) once, not twice."""
    import torch

    import globaltensor as gt
    if gt.get_world_size() != 2:
        return
    p = gt.placement.all("cpu")
    z = gt.tensor(randn((8, 5), "ce_once"), placement=p, sbp=S(0))
    t = gt.tensor(randint(5, (8,), "ce_once_t"), placement=p, sbp=S(0))
    with gt.debug.comm_stats() as counted:
        loss = F.cross_entropy(z, t)
    # one for the target check, one for the (sum, weight) reduction
    assert counted.calls["all_reduce"] == 2, counted
    torch.testing.assert_close(loss.item(), F.cross_entropy(z.full(), t.full()).item())


CHECKS = ["check_softmax_and_losses", "check_cross_entropy_over_split_rows_checks_targets_once"]
test_world2, test_world4, test_bystanders = battery_tests(__name__, CHECKS)
