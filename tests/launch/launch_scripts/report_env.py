"""Each rank prints its launcher-provided environment, runs an all_reduce, echoes its args;
at exit a non-daemon thread it started prints, then an atexit handler."""
import json
import os
import socket
import struct
import sys

# The launcher's fork server imported torch already, and what a first op imports
PRELOADED = all(m in sys.modules for m in ("torch", "torch._dynamo", "torch.distributed.tensor"))

import atexit  # noqa: E402
import concurrent.futures  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist

KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"]


def listening_addresses(port: int) -> list:
    """Addresses with a socket listening on ``port`` on this machine (/proc/net/tcp*)."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                # the kernel prints the address as 32-bit words in host byte order
                raw = b"".join(struct.pack("=I", int(addr_hex[i:i + 8], 16))
                               for i in range(0, len(addr_hex), 8))
                found.append(socket.inet_ntop(family, raw))
    return sorted(found)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    info = {k: os.environ.get(k) for k in KEYS}
    # __spec__ is set only when run with `python -m`.
    info.update(listening=listening_addresses(int(os.environ["MASTER_PORT"])),
                allreduce=t.item(), argv=sys.argv[1:], module=__spec__.name if __spec__ else None,
                threads=torch.get_num_threads(), random=random.random(), preloaded=PRELOADED)
    print("ENV " + json.dumps(info, sort_keys=True))
    print(f"stderr-line-from-rank-{rank}", file=sys.stderr)
    print(f"stdout-after-stderr-rank-{rank}")
    dist.destroy_process_group()
    # the interpreter's exit: non-daemon threads first, then atexit handlers; an idle
    # pool's worker thread is stopped by threading's exit hook (torch.compile keeps one)
    global POOL
    POOL = concurrent.futures.ThreadPoolExecutor(1)  # kept, as torch.compile keeps its pool
    POOL.submit(int).result()
    release = threading.Event()
    threading.Thread(target=lambda: (release.wait(), print("thread joined"))).start()
    atexit.register(print, "atexit ran")
    release.set()


if __name__ == "__main__":
    main()
