"""Restarted twice (--max_restarts 2): rank 1 is SIGKILLed in attempt 0 and rank 0 in
attempt 1, each after a collective (the attempt's keys are in the store); attempt 2
finishes. Every attempt must build its process group afresh."""
import datetime
import os
import signal

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank()
x = torch.ones(4)
dist.all_reduce(x)
if (attempt, rank) in ((0, 1), (1, 0)):
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
print(f"attempt {attempt} done: {x.sum().item():g}", flush=True)
dist.destroy_process_group()
