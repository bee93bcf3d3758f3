"""Failing job, mode from argv[1]:
`exit`  -> rank 1 prints 30 numbered lines and exits with code 3;
`raise` -> rank 1 raises while rank 0 waits in a barrier (uses elastic's @record).
"""
import sys

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} started")
    if rank == 1:
        if mode == "exit":
            for i in range(30):
                print(f"rank1 line {i:02d}")
            sys.exit(3)
        raise RuntimeError("boom from rank 1")
    dist.barrier()  # rank 0 blocks here until the launcher stops it
    print("rank 0 passed the barrier (should not happen)")


if __name__ == "__main__":
    main()
