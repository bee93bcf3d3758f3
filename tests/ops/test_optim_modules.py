"""Optimizers (SGD, Adam foreach and for-loop, AdamW) and clip_grad_norm_ on global
modules: the same parameters and gradients as single-process torch.

Run in the shared worlds of tests/ops/ops_battery.py (2, 4, and 3 with bystanders)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from ops_battery import (
    B,
    S,
    as_tuple,
    battery_tests,
    checked,
    close,
    expect,
    guard,
    line,
    mesh,
    randint,
    randn,
    same_on_every_rank,
)

import globaltensor as gt


def _mlp():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                   torch.nn.Linear(5, 3))


OPTIMIZERS = {
    "SGD(momentum)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam(foreach)": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "Adam(for-loop)": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _train(label, placement, sbp, data_sbp, make_opt, steps=3):
    where = f"[world {gt.get_world_size()}] {label} on {placement.ranks}"
    X, Y = randn((7, 6), "trainX", dtype=torch.float32), randn((7, 3), "trainY",
                                                               dtype=torch.float32)
    ref = _mlp()
    model = gt.nn.to_global(copy.deepcopy(ref), placement, sbp)
    gx = gt.tensor(X, placement=placement, sbp=data_sbp)
    gy = gt.tensor(Y, placement=placement, sbp=data_sbp)
    opt, ref_opt = make_opt(list(model.parameters())), make_opt(list(ref.parameters()))
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = F.mse_loss(model(gx), gy)
        ref_loss = F.mse_loss(ref(X), Y)
        loss.backward()
        ref_loss.backward()
        close(loss.full(), ref_loss.detach(), f"{where} loss at step {step}", 1e-5, 1e-6)
        opt.step()
        ref_opt.step()
    for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
        if not expect(gt.is_global(got), f"{where} {name}: not a GlobalTensor"):
            continue
        expected = sbp(name, want) if callable(sbp) else sbp
        expect(got.placement == placement and got.sbp == as_tuple(expected),
               f"{where} {name}: layout {got.sbp} on {got.placement.ranks}")
        close(got.full(), want.detach(), f"{where} {name} after {steps} steps", 1e-5, 1e-5)


def _clip(label, placement, sbp, data_sbp, foreach):
    where = f"[world {gt.get_world_size()}] {label} on {placement.ranks}"
    X, Y = randn((7, 6), "clipX", dtype=torch.float32), randn((7, 3), "clipY",
                                                              dtype=torch.float32)
    ref = _mlp()
    model = gt.nn.to_global(copy.deepcopy(ref), placement, sbp)
    F.mse_loss(model(gt.tensor(X, placement=placement, sbp=data_sbp)),
               gt.tensor(Y, placement=placement, sbp=data_sbp)).backward()
    F.mse_loss(ref(X), Y).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=foreach)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=foreach)
    total = total.full() if gt.is_global(total) else torch.as_tensor(total)
    close(total, ref_total, f"{where} total norm", 1e-5, 1e-6)
    for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
        close(got.grad.full(), want.grad, f"{where} clipped grad of {name}", 1e-5, 1e-6)


@checked
def check_optimizers_and_modules():
    p = line()

    def rows_of_first(name, t):
        return S(0) if name == "0.weight" else B

    configs = [("broadcast params", p, B, S(0)), ("0.weight split(0)", p, rows_of_first, S(0))]
    if gt.get_world_size() == 4:
        def mesh_sbp(name, t):
            return (B, S(0)) if name == "0.weight" else (B, B)
        configs.append(("mesh params", mesh(), mesh_sbp, (S(0), B)))
    for label, placement, sbp, data_sbp in configs:
        for opt_name, make in OPTIMIZERS.items():
            if label == "mesh params" and opt_name in ("Adam(for-loop)", "AdamW"):
                continue
            name = f"{opt_name} {label}, data {data_sbp}"
            guard(f"[world {gt.get_world_size()}] {name} on {placement.ranks}",
                  lambda: _train(name, placement, sbp, data_sbp, make))
        for foreach in (True, False):
            name = f"clip_grad_norm_(foreach={foreach}) {label}"
            guard(f"[world {gt.get_world_size()}] {name} on {placement.ranks}",
                  lambda: _clip(name, placement, sbp, data_sbp, foreach))


def _megatron(name, t):
    """The MLP below in Megatron's layout: the first Linear column-split (weight and
    bias split(0)), the second row-split (weight split(1)), the rest broadcast."""
    return {"1.weight": S(0), "1.bias": S(0), "3.weight": S(1)}.get(name, B)


@checked
def check_megatron_mlp_on_ranks_0_1():
    """Issue 10's reproduction: a Megatron MLP and its data on [0, 1] of a larger world;
    forward, cross_entropy and backward on every rank. The ranks outside [0, 1] raised
    (native_layer_norm_backward's None outputs) and left ranks 0 and 1 waiting."""
    p = gt.placement("cpu", [0, 1])
    where = f"[world {gt.get_world_size()}] Megatron MLP on [0, 1]"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10)
        ref = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32),
                                  torch.nn.GELU(), torch.nn.Linear(32, 10))
    model = gt.nn.to_global(copy.deepcopy(ref), p, _megatron)
    X, Y = randn((8, 16), "megX", dtype=torch.float32), randint(10, (8,), "megY")

    def forward_backward():
        loss = F.cross_entropy(model(gt.tensor(X, placement=p, sbp=B)),
                               gt.tensor(Y, placement=p, sbp=B))
        loss.backward()
        ref_loss = F.cross_entropy(ref(X), Y)
        ref_loss.backward()
        same_on_every_rank(f"{where} loss", [loss])
        close(loss.full(), ref_loss.detach(), f"{where} loss", 1e-5, 1e-6)
        same_on_every_rank(f"{where} gradients", [q.grad for q in model.parameters()])
        for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
            expect(got.grad.placement == p and got.grad.sbp == got.sbp,
                   f"{where} grad of {name}: {got.grad.sbp} on {got.grad.placement.ranks}")
            close(got.grad.full(), want.grad, f"{where} grad of {name}", 1e-5, 1e-6)

    guard(where, forward_backward)


CHECKS = ["check_optimizers_and_modules"]
test_world2, test_world4, test_bystanders = battery_tests(
    __name__, CHECKS, bystander_checks=["check_megatron_mlp_on_ranks_0_1"])
