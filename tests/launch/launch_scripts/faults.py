"""Jobs that go wrong in one way each, mode from argv[1] (2 ranks):
`early` -> rank 1 exits 0 right after joining; rank 0 then waits in an all_reduce;
`hang`  -> rank 1 never joins the barrier (stuck in `stuck_here`), rank 0 times out (3 s);
`quiet` -> every rank exits 1, only rank 0 says why;
`sleep` -> every rank prints its pid and sleeps (for killing the launcher);
`sigkill` / `sigsegv` / `sigterm` -> rank 1 gets that signal from outside (it sends it to
           itself: the launcher did not) while rank 0 waits in an all_reduce;
`silent` -> rank 1 exits 3 without a word while rank 0 waits in an all_reduce.
"""
import datetime
import os
import signal
import sys
import time


def stuck_here() -> None:
    time.sleep(120)


def main() -> None:
    mode, rank = sys.argv[1], int(os.environ["RANK"])
    if mode == "quiet":
        if rank == 0:
            print("rank 0: config error: the reason everyone stops")
        sys.exit(1)
    if mode == "sleep":
        print(f"PID {os.getpid()}", flush=True)
        time.sleep(120)
        return
    import torch  # after the modes that need no torch: they end within moments
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    if mode == "early":
        if rank == 1:
            # Ends at once: with sys.exit, gloo's teardown during interpreter exit closed
            # the connection (failing rank 0) while this process still ran, so which rank
            # ended first was a race the summary cannot be asked to get right.
            sys.stdout.flush()
            os._exit(0)
        dist.all_reduce(torch.ones(4))
    elif mode in ("sigkill", "sigsegv", "sigterm", "silent"):
        if rank == 1:
            if mode == "silent":
                os._exit(3)
            # SIGTERM's default action; the launcher's boot chains to it after its stack dump
            os.kill(os.getpid(), getattr(signal, mode.upper()))
            time.sleep(30)
        dist.all_reduce(torch.ones(4))
    elif mode == "hang":
        if rank == 1:
            stuck_here()
        dist.barrier()
    print(f"rank {rank} got through (should not happen)")


if __name__ == "__main__":
    main()
