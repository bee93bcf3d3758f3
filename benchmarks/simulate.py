"""A step of the nanoGPT-style GPT at 8 to 1024 ranks, simulated (``gt.debug.simulate_step``).

    python benchmarks/simulate.py                       # 8, 64, 256, 1024 ranks, h100
    python benchmarks/simulate.py --worlds 8,64 --layouts dp,fs --device cpu

For each world size and layout, rank 0 of that world is simulated in this process (no
other processes): its memory at the step's peak (parameters, gradients, optimizer
state, all), the bytes it sends per step, and the estimated step time on the device
profile. Layouts: ``dp`` data parallel (parameters broadcast, batch split), ``fs``
fully_shard (each block a unit), ``tp`` Megatron tensor parallel over the whole world
(q/k/v/fc1 split(0), proj/fc2 weight split(1)), ``2d`` data x Megatron on (world / 8)
x 8. The batch holds ``--rows`` sequences per data-parallel rank. Estimates of the
cost model and the profile: see docs/debugging.md for what they leave out.
"""
from __future__ import annotations

import argparse
import time

import torch
from tp import GPT, Config, _megatron_sbp

import globaltensor as gt


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="8,64,256,1024")
    ap.add_argument("--layouts", default="dp,fs,tp,2d")
    ap.add_argument("--device", default="h100", help="cpu, h100, h200")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--rows", type=int, default=4, help="sequences per data-parallel rank")
    return ap


def _make(cfg: Config, layout: str, rows: int):
    def make():
        world = gt.get_world_size()
        if layout == "2d":
            P = gt.placement("cpu", [list(range(r * 8, r * 8 + 8)) for r in range(world // 8)])
        else:
            P = gt.placement.all("cpu")
        model = GPT(cfg)   # (simulate_step makes it of fake tensors: no memory)
        if layout == "dp":
            model = gt.nn.to_global(model, P, gt.sbp.broadcast)
        elif layout == "fs":
            model = gt.nn.to_global(model, P, gt.sbp.broadcast)
            for block in model.h:
                gt.nn.fully_shard(block, P)
            model = gt.nn.fully_shard(model, P)
        else:   # Megatron over the world, or over axis 1 of the 2-D mesh
            tp = (lambda name, t: _megatron_sbp(name)) if layout == "tp" else \
                (lambda name, t: (gt.sbp.broadcast, _megatron_sbp(name)))
            model = gt.nn.to_global(model, P, tp)
        data = P.shape[0] if layout != "tp" else 1
        batch = (gt.sbp.split(0),) * (P.ndim - 1) + (gt.sbp.broadcast,) if layout == "2d" \
            else (gt.sbp.broadcast if layout == "tp" else gt.sbp.split(0))
        idx = gt.randint(0, cfg.vocab, (rows * data, cfg.block), placement=P, sbp=batch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step, model, opt
    return make


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    cfg = Config(args.vocab, args.seq, args.dim, args.heads, args.layers)
    lines = [f"GPT {args.layers} layers, width {args.dim}, {args.heads} heads, sequence "
             f"{args.seq}, vocabulary {args.vocab}; {args.rows} sequences per data-parallel "
             f"rank; rank 0, device {args.device}, AdamW fp32",
             f"{'layout':<7}{'ranks':>6}{'peak MiB':>10}{'params':>9}{'grads':>9}{'optim':>9}"
             f"{'sent MiB':>10}{'step ms':>9}{'compute':>9}{'comm':>9}{'sim s':>7}"]
    lines.append("-" * len(lines[-1]))
    print("\n".join(lines), flush=True)
    for layout in args.layouts.split(","):
        for world in map(int, args.worlds.split(",")):
            if layout == "2d" and world % 8:
                continue
            t0 = time.perf_counter()
            r = gt.debug.simulate_step(_make(cfg, layout, args.rows),
                                       placement=gt.placement("cpu", ranks=range(world)),
                                       device=args.device)
            m, mib = r.memory, 1 << 20
            line = (f"{layout:<7}{world:>6}{m['peak'] / mib:>10.0f}{m['parameters'] / mib:>9.0f}"
                    f"{m['gradients'] / mib:>9.0f}{m['optimizer'] / mib:>9.0f}"
                    f"{r.bytes / mib:>10.0f}{r.seconds * 1e3:>9.1f}{r.compute_seconds * 1e3:>9.1f}"
                    f"{r.comm_seconds * 1e3:>9.1f}{time.perf_counter() - t0:>7.1f}")
            print(line, flush=True)


if __name__ == "__main__":
    from _docs import docs_section
    with docs_section("simulate"):   # --write-docs: its table into docs/benchmarks.md
        main()
