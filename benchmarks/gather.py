"""All-gathers on gloo: ``comm.all_gather_into`` by point-to-point messages (what it does
for parts of ``GATHER_BY_MESSAGES_BYTES`` or more) against gloo's own all_gather (what it
does below), side by side in one run, fingerprints on, a fresh output per call.

    python benchmarks/gather.py                        # worlds of 2 and 4, parts 256 KiB-4 MiB
    python benchmarks/gather.py --worlds 2 --parts 524288,8388608 --iters 30

Prints the median ms per call (the slowest rank's) of each way and their ratio.
"""
from __future__ import annotations

import argparse

import torch
from _common import round_robin_median

from globaltensor.testing import spawn


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma list of world sizes")
    ap.add_argument("--parts", default="262144,524288,1048576,4194304",
                    help="bytes of each rank's part (fp32), comma list")
    ap.add_argument("--iters", type=int, default=15)
    return ap


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    import globaltensor as gt
    from globaltensor import comm
    from globaltensor.comm import collectives
    gt.init()
    n, ranks = gt.get_world_size(), tuple(range(gt.get_world_size()))
    limit = collectives.GATHER_BY_MESSAGES_BYTES
    rows = []
    for nbytes in (int(b) for b in args.parts.split(",")):
        part = torch.randn(nbytes // 4)

        def gather(way_limit, part=part):
            collectives.GATHER_BY_MESSAGES_BYTES = way_limit   # (every rank alike)
            try:
                comm.all_gather_into(torch.empty(n * part.numel()), part, ranks)
            finally:
                collectives.GATHER_BY_MESSAGES_BYTES = limit
        gloo, messages = round_robin_median(
            [lambda: gather(1 << 62), lambda: gather(0)], args.iters)
        rows.append((nbytes, gloo * 1e3, messages * 1e3))
    if gt.get_rank() == 0:
        for nbytes, gloo, messages in rows:
            way = "messages" if nbytes >= limit else "gloo"
            print(f"{n:>5} {nbytes / 2**20:9.2f} MiB {gloo:12.3f} {messages:12.3f} "
                  f"{messages / gloo:7.2f}   {way}")


def run(argv=None) -> None:
    args = _parser().parse_args(argv)
    from globaltensor.comm import collectives
    print(f"gloo all-gathers, fresh output, fingerprints on; medians of {args.iters} "
          f"rounds (ms per call, slowest rank); parts of "
          f"{collectives.GATHER_BY_MESSAGES_BYTES >> 10} KiB or more go by messages")
    print(f"{'world':>5} {'part':>13} {'gloo all_gather':>12} {'by messages':>12} {'ratio':>7}   used")
    for n in (int(w) for w in args.worlds.split(",")):
        spawn(main, n, argv)


if __name__ == "__main__":
    import sys

    from _docs import docs_section
    with docs_section("gather"):   # --write-docs: its table into docs/benchmarks.md
        run(sys.argv[1:])
