"""A step of the nanoGPT-style GPT (or of a Llama) at 8 to 1024 ranks, simulated
(``gt.debug.simulate_step``).

    python benchmarks/simulate.py                       # 8, 64, 256, 1024 ranks, h100
    python benchmarks/simulate.py --model llama         # a Llama of about 1.2B parameters
    python benchmarks/simulate.py --worlds 8,64 --layouts dp,fs --device cpu
    python benchmarks/simulate.py --measure --worlds 2,4 --layouts dp,tp,fs --dim 256 \
        --heads 8 --layers 2 --seq 128 --vocab 1024      # estimated against real worlds here
    python benchmarks/simulate.py --measure --device cuda --worlds 1 --layouts dp  # a GPU's

For each world size and layout, rank 0 of that world is simulated in this process (no
other processes): its memory at the step's peak (parameters, gradients, optimizer state,
all), the bytes it sends per step, and the estimated step time on the device profile.
Layouts: ``dp`` data parallel (parameters broadcast, batch split), ``fs`` fully_shard on
each block and then the model (each module owning parameters a unit), ``fsc`` the same
with FSDP2's units (``unit="call"``: each block one unit), ``tp`` Megatron tensor
parallel over the whole world (q/k/v/fc1 split(0), proj/fc2 weight split(1)), ``2d``
data x Megatron on (world / 8) x 8. The batch holds ``--rows`` sequences per
data-parallel rank. ``--model llama``: the Llama of ``examples/llama_2d.py`` (RMSNorm,
rotary positions, grouped-query attention, SwiGLU) at the sizes given (defaults: width
2048, 16 layers, 32 heads, 8 key/value heads, hidden 8192, vocabulary 32000, sequence
2048: about 1.2B parameters), Megatron's split on its q/k/v/w1/w3 (outputs) and wo/w2
(inputs). Estimates of the cost model and the profile: see docs/debugging.md for what
they leave out.

``--measure`` (``--device cpu``) also runs each point in a real world of that size on
this machine (gloo, op by op): the median of ``--steps`` timed steps and the peak of
the ranks' tensors (torch's ``MemTracker``, as the simulation counts), with the
estimate's ratio to each. ``--device cuda --measure`` does the same on this machine's
GPUs (one per rank: the worlds up to their number), simulated on its GPU's profile
(``gt.debug.PROFILES`` by the device's name), each step timed to its last kernel. In a
world of more than one rank it also times a 1 KiB all-reduce while the ranks compute
between collectives (``_measured_all_reduce_seconds``): on a machine whose cores the
ranks share, a collective waits for the others' turns, which the "cpu" profile's link
(gloo's launch, ``cost.GLOO``) does not know. The estimate is given twice: with the
profile as it is, and with its link's launch taken from that measurement
(``launch``, ``est/real`` beside it).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from _common import example_module
from tp import GPT, Config, _megatron_sbp

import globaltensor as gt
from globaltensor import device_profile


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="8,64,256,1024")
    ap.add_argument("--layouts", default="dp,fs,tp,2d")
    ap.add_argument("--device", default="h100",
                    help="a profile: cpu, h100, h200; or cuda: this machine's GPU's")
    ap.add_argument("--model", default="gpt", choices=("gpt", "llama"))
    ap.add_argument("--dim", type=int, default=None, help="gpt 768, llama 2048")
    ap.add_argument("--heads", type=int, default=None, help="gpt 12, llama 32")
    ap.add_argument("--kv-heads", type=int, default=8, help="llama's key/value heads")
    ap.add_argument("--hidden", type=int, default=8192, help="llama's feed-forward width")
    ap.add_argument("--layers", type=int, default=None, help="gpt 12, llama 16")
    ap.add_argument("--seq", type=int, default=None, help="gpt 1024, llama 2048")
    ap.add_argument("--vocab", type=int, default=None, help="gpt 50304, llama 32000")
    ap.add_argument("--rows", type=int, default=4, help="sequences per data-parallel rank")
    ap.add_argument("--measure", action="store_true",
                    help="also run each point in a real world here (cpu device)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps when measuring")
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)   # a measured world's
    ap.add_argument("--measured-to", default=None, help=argparse.SUPPRESS)   # its rank 0's file
    return ap


_DEFAULTS = {"gpt": dict(dim=768, heads=12, layers=12, seq=1024, vocab=50304),
             "llama": dict(dim=2048, heads=32, layers=16, seq=2048, vocab=32000)}


def _config(args):
    """The model's sizes: ``args`` with the model's defaults where not given."""
    for name, value in _DEFAULTS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model == "gpt":
        return Config(args.vocab, args.seq, args.dim, args.heads, args.layers)
    return _llama().LlamaConfig(args.dim, args.heads, args.kv_heads, args.hidden, args.vocab,
                                args.layers), args.seq


def _llama():
    """``examples/llama_2d.py`` as a module."""
    return example_module("llama_2d")


def _model(cfg):
    """(the model, its blocks, its Megatron sbp of a parameter name, vocabulary,
    sequence, loss of a batch of ids)."""
    if isinstance(cfg, Config):
        model = GPT(cfg)
        return model, model.h, _megatron_sbp, cfg.vocab, cfg.block, lambda ids: model(ids, ids)
    cfg, seq = cfg
    llama = _llama()
    model = llama.Llama(cfg)

    def loss(ids):
        return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    return (model, model.layers, lambda name: llama.megatron(name, None)[1], cfg.vocab, seq,
            loss)


def _make(cfg, layout: str, rows: int, device: str = "cpu"):
    def make():
        world = gt.get_world_size()
        if layout == "2d":
            P = gt.placement(device, [list(range(r * 8, r * 8 + 8)) for r in range(world // 8)])
        else:
            P = gt.placement.all(device)
        # (simulate_step makes it of fake tensors: no memory)
        model, blocks, megatron, vocab, seq, loss_of = _model(cfg)
        if layout == "dp":
            gt.nn.to_global(model, P, gt.sbp.broadcast)
        elif layout in ("fs", "fsc"):
            gt.nn.to_global(model, P, gt.sbp.broadcast)
            unit = "call" if layout == "fsc" else "module"
            for block in blocks:
                gt.nn.fully_shard(block, P, unit=unit)
            gt.nn.fully_shard(model, P, unit=unit)
        else:   # Megatron over the world, or over axis 1 of the 2-D mesh
            tp = (lambda name, t: megatron(name)) if layout == "tp" else \
                (lambda name, t: (gt.sbp.broadcast, megatron(name)))
            gt.nn.to_global(model, P, tp)
        data = P.shape[0] if layout != "tp" else 1
        batch = (gt.sbp.split(0),) * (P.ndim - 1) + (gt.sbp.broadcast,) if layout == "2d" \
            else (gt.sbp.broadcast if layout == "tp" else gt.sbp.split(0))
        idx = gt.randint(0, vocab, (rows * data, seq), placement=P, sbp=batch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = loss_of(idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step, model, opt
    return make


def _measured(argv) -> None:
    """One rank of a real world: the step's peak tensor memory and median time, and a
    small collective's time among busy ranks (rank 0 writes them for the parent). On
    cuda (``--device cuda``) each rank on its GPU, each step timed to its last kernel."""
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from globaltensor.step_simulation import _by_kind, _tracker
    args = _parser().parse_args(argv)
    gt.init()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(gt.get_local_rank())
    done = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    step, model, opt = _make(_config(args), args.layout, args.rows, "cuda" if cuda else "cpu")()
    for _ in range(3):
        step()
    tracker = _tracker(MemTracker)()   # (as the simulation's: gathered copies not hooked)
    tracker.track_external(model, opt)
    with tracker:
        step()
    times = []
    for _ in range(args.steps):
        done()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        done()
        times.append(time.perf_counter() - t0)
    collective = _measured_all_reduce_seconds() if dist.get_world_size() > 1 else 0.0
    if dist.get_rank() == 0:
        with open(args.measured_to, "w") as f:
            f.write(f"{_by_kind(tracker)['peak']} {statistics.median(times)} {collective}")


def _measured_all_reduce_seconds(rounds: int = 40) -> float:
    """The median wall seconds of a 1 KiB all-reduce among this world's ranks, each
    rank computing between two (a burst of products, as a step's ops come between its
    collectives): on cores the ranks share, what a collective costs with its waits."""
    import torch.distributed as dist
    a, b, x, times = torch.randn(128, 128), torch.randn(128, 128), torch.ones(256), []
    for _ in range(rounds):
        for _ in range(2):
            a @ b
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[rounds // 4:])


def _measured_launch(profile, seconds: float, world: int):
    """``profile`` with its link's launch such that a 1 KiB all-reduce among ``world``
    ranks costs the measured ``seconds`` (at least the launch it had)."""
    from globaltensor.step_simulation import collective_seconds
    link = profile.links[0]
    sent = 2 * 1024 * (world - 1) // world   # (what comm/collectives.py records it sends)
    launch = seconds - collective_seconds(dataclasses.replace(link, launch=0.0), "all_reduce",
                                          sent, world)
    link = dataclasses.replace(link, launch=max(link.launch, launch))
    return dataclasses.replace(profile, links=(link,) + tuple(profile.links[1:]))


def _measure(layout: str, world: int) -> tuple:
    """(peak bytes, median step seconds, a 1 KiB all-reduce's seconds among busy
    ranks) of rank 0 of a real world of ``world``."""
    import sys
    import tempfile

    from globaltensor.testing import spawn
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/measured"
        spawn(_measured, world, sys.argv[1:] + ["--layout", layout, "--measured-to", path])
        with open(path) as f:
            peak, seconds, collective = f.read().split()
    return int(peak), float(seconds), float(collective)


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if args.layout is not None:   # a rank of a measured world
        return _measured(argv)
    if args.measure and args.device not in ("cpu", "cuda"):
        raise SystemExit("--measure compares with this machine: use --device cpu or cuda")
    profile = _this_gpu() if args.device == "cuda" else args.device
    cfg = _config(args)
    more = (f"{'real ms':>9}{'est/real':>9}{'launch':>8}{'est/real':>9}{'real MiB':>9}"
            f"{'est/real':>9}") if args.measure else ""
    heads = f"{args.heads} heads" + (f" ({args.kv_heads} key/value), hidden {args.hidden}"
                                     if args.model == "llama" else "")
    lines = [f"{args.model.upper() if args.model == 'gpt' else 'Llama'} {args.layers} layers, "
             f"width {args.dim}, {heads}, sequence {args.seq}, vocabulary {args.vocab}; "
             f"{args.rows} sequences per data-parallel rank; rank 0, device {args.device}, "
             f"AdamW fp32" + ("; launch: ms per collective measured in the real world"
                              if args.measure else ""),
             f"{'layout':<7}{'ranks':>6}{'peak MiB':>10}{'params':>9}{'grads':>9}{'optim':>9}"
             f"{'sent MiB':>10}{'step ms':>9}{'compute':>9}{'comm':>9}{'host':>9}{'sim s':>7}"
             + more]
    lines.append("-" * len(lines[-1]))
    print("\n".join(lines), flush=True)
    for layout in args.layouts.split(","):
        for world in map(int, args.worlds.split(",")):
            if layout == "2d" and world % 8:
                continue
            if args.device == "cuda" and world > torch.cuda.device_count():
                print(f"{layout:<7}{world:>6}  (not run: {torch.cuda.device_count()} GPU(s) "
                      f"here, one per rank)", flush=True)
                continue
            if args.measure:   # the machine as it is now: its speed drifts over minutes
                peak, seconds, collective = _measure(layout, world)
                device_profile.cpu_profile.cache_clear()
                device_profile.host_op_seconds.cache_clear()
            t0 = time.perf_counter()
            r = _simulated(cfg, layout, args.rows, world, profile, args.device)
            m, mib = r.memory, 1 << 20
            line = (f"{layout:<7}{world:>6}{m['peak'] / mib:>10.0f}{m['parameters'] / mib:>9.0f}"
                    f"{m['gradients'] / mib:>9.0f}{m['optimizer'] / mib:>9.0f}"
                    f"{r.bytes / mib:>10.0f}{r.seconds * 1e3:>9.1f}{r.compute_seconds * 1e3:>9.1f}"
                    f"{r.comm_seconds * 1e3:>9.1f}{r.host_seconds * 1e3:>9.1f}"
                    f"{time.perf_counter() - t0:>7.1f}")
            if args.measure:
                calibrated = _measured_launch(device_profile.profile_of(profile), collective,
                                              world) if world > 1 else r.device
                again = _simulated(cfg, layout, args.rows, world, calibrated, args.device)
                line += (f"{seconds * 1e3:>9.1f}{r.seconds / seconds:>9.2f}"
                         f"{calibrated.links[0].launch * 1e3:>8.2f}{again.seconds / seconds:>9.2f}"
                         f"{peak / mib:>9.1f}{m['peak'] / peak:>9.2f}")
            print(line, flush=True)


def _simulated(cfg, layout: str, rows: int, world: int, profile, device: str = "cpu"):
    """Rank 0 of ``world`` simulated on ``profile``, its placements on ``device`` ("cpu"
    for a profile's name: only the profile prices the step)."""
    device = "cuda" if device == "cuda" else "cpu"
    return gt.debug.simulate_step(_make(cfg, layout, rows, device),
                                  placement=gt.placement(device, ranks=range(world)),
                                  device=profile)


def _this_gpu() -> str:
    """The profile (``gt.debug.PROFILES``) of this machine's GPU, by its name."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    name = torch.cuda.get_device_name(0)
    for key in gt.debug.PROFILES:
        if key.lower() in name.lower():
            return key
    raise SystemExit(f"no profile for {name!r} in gt.debug.PROFILES "
                     f"({', '.join(gt.debug.PROFILES)}): add one to compare with it")


if __name__ == "__main__":
    import sys

    from _docs import docs_section
    # --write-docs: its table into docs/benchmarks.md, a section per model
    with docs_section("simulate_llama" if "llama" in sys.argv[1:] else "simulate"):
        main()
