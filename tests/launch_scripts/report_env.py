"""Each rank prints its launcher-provided environment, runs an all_reduce, echoes its args."""
import json
import os
import sys

import torch
import torch.distributed as dist

KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    info = {k: os.environ.get(k) for k in KEYS}
    # __spec__ is set only when run with `python -m`.
    info.update(allreduce=t.item(), argv=sys.argv[1:], module=__spec__.name if __spec__ else None)
    print("ENV " + json.dumps(info, sort_keys=True))
    print(f"stderr-line-from-rank-{rank}", file=sys.stderr)
    print(f"stdout-after-stderr-rank-{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
