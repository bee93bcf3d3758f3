"""Rank 1 leaves right after the world is made, with code 0, how from argv[1]:
`exit`   -> sys.exit(0);
`return` -> main() returns.
Rank 0 then waits in an all_reduce: it fails once rank 1's exit destroys its process group
(connection reset), which happens while rank 1's process still runs (interpreter
shutdown), or after GLOBALTENSOR_TIMEOUT seconds.
"""
import os
import sys

import torch
import torch.distributed as dist

import globaltensor as gt


def main() -> None:
    gt.init()  # as a globaltensor program does: its groups are destroyed at exit (atexit)
    if int(os.environ["RANK"]) == 1:
        if sys.argv[1] == "exit":
            sys.exit(0)
        return
    dist.all_reduce(torch.ones(4))
    print("rank 0 got through (should not happen)")


if __name__ == "__main__":
    main()
