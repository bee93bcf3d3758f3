"""Start one worker process per device: a thin layer over ``torch.distributed.elastic``.

The elastic agent behind ``torchrun`` (``torch.distributed.launcher.api``) does the
real work: it spawns the workers, sets RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, watches them and stops the rest when
one fails. This package adds a Paddle-style front end on top of it: a start banner,
one ``<log_dir>/workerlog.<global rank>`` file per rank (stdout and stderr
combined, also echoed to the console as ``[rank<N>]: ...``) in a directory of the
job's own (``log/<run id>/`` by default, see ``globaltensor.launch.logs``), and a short
failure summary that names the rank that caused the failure instead of a traceback.
``--standalone`` and ``--nproc_per_node auto`` mean what they mean to torchrun.

What it adds to the agent, and why:

- the rendezvous store (a TCPStore on node 0) listens on ``--master_addr`` only
  (loopback by default), not on every interface: anyone who reaches the store can
  write into the job;
- nodes wait for each other for ``--rdzv_timeout`` seconds, saying what they wait for;
- workers are forked from a copy of the launcher that imported torch already (``--start_method
  forkserver``, the default on Linux): they start in milliseconds, not seconds;
- workers die with the launcher (Linux parent-death signal), even when it is SIGKILLed;
- a worker stopped by the launcher prints where it was (``faulthandler``), so a hung
  rank shows up as the hung rank, not as its peer's failure;
- log files are opened without following symbolic links, and a job locks its log
  directory: a second job started there is refused instead of truncating the logs;
- when a worker fails, the others get ``FAILURE_GRACE_S`` to end on their own before
  they are stopped, so ranks that fail together (a bad config) are all reported as
  failed, with their exit codes, instead of as stopped by the launcher.

Parameter-server jobs (``--server_num S --worker_num W``, one node): S + W processes
run the same script; global ranks ``0..W-1`` are the workers and ``W..W+S-1`` the
servers. Each process finds its role in ``GLOBALTENSOR_PS_ROLE`` (``server`` or
``worker``) and its rank within the role in ``GLOBALTENSOR_PS_RANK``
(``GLOBALTENSOR_PS_SERVER_NUM`` / ``GLOBALTENSOR_PS_WORKER_NUM`` hold the counts; see
``globaltensor.ps``). Logs are ``serverlog.<N>`` and ``workerlog.<N>`` by role rank, and
the failure summary names the role: ``server 1 (rank 3) exited with code 1``. Servers
end when every worker has said it is done (``gt.ps.run_server`` returns), so a job
whose workers all finish exits 0.

The package, one room per concern (each imports only the rooms above it in this list,
and torch's elastic modules only inside the functions that start a job)::

    logs.py        per-job log directories, their lock, the agent's LogsSpecs, reading logs
    cli.py         the option table, parsing and validation (a new option goes here only)
    rendezvous.py  node 0's store on --master_addr only, the nodes' wait, port claiming
    agent.py       the elastic agent with a grace period, the worker exit-time watcher
    report.py      the start banner and the failure summary
    boot.py        the worker process's first code (run as a file by every worker)
    forkserver.py  forks the workers from a copy of the launcher; a Popen stand-in for the agent
    job.py         main: the steps above, in order

Example::

    python -m globaltensor.launch --nproc_per_node 4 train.py --lr 0.1
    python -m globaltensor.launch --standalone --nproc_per_node auto train.py
    python -m globaltensor.launch --server_num 2 --worker_num 2 train.py
    # two machines, run once on each (node_rank 0 hosts the rendezvous store):
    python -m globaltensor.launch --nnodes 2 --node_rank 0 --nproc_per_node 2 \\
        --master_addr NODE0_ADDR --master_port 29500 train.py
"""

from .cli import parse_args
from .job import main

# The role-aware names of ranks and their logs (tests/ps/test_ps.py checks them here).
from .logs import log_name as _log_name  # noqa: F401
from .report import who as _who  # noqa: F401

__all__ = ["main", "parse_args"]
