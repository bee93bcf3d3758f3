"""The launcher's command line: the option table, parsing and validation.

Every launcher option is one row of ``OPTIONS``: the parser, its ``--help``, both
spellings (``--nproc_per_node`` and ``--nproc-per-node``, as torchrun) and the split
between the launcher's arguments and the script's all come from that table, so a new
option is a new row here (and its checks in ``_problems``), nothing elsewhere.
Everything after the script belongs to the script, even ``--nnodes`` or ``--``.

Example::

    args = parse_args(["--nproc_per_node", "2", "train.py", "--lr", "0.1"])
    args.nproc_per_node, args.script, args.script_args   # (2, 'train.py', ['--lr', '0.1'])
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, Sequence

from .logs import DEFAULT_LOG_ROOT, LATEST_LINK, say, worker_log

__all__ = ["OPTIONS", "Option", "build_parser", "fail", "node_ranks", "parse_args"]

PROG = "python -m globaltensor.launch"
START_METHODS = ("forkserver", "spawn")
USAGE_HINT = f"usage: {PROG} [options] script.py [args]"


@dataclass(frozen=True)
class Option:
    """One launcher option: ``--<name>``, also spelt with dashes (``--node-rank``).

    ``type`` converts the value (None: a string); ``flag`` options take no value.

    >>> Option("node_rank", "rank of this node", type=int, default=0).spellings
    ('--node_rank', '--node-rank')
    """

    name: str
    help: str
    type: Optional[Callable[[str], Any]] = None
    default: Any = None
    flag: bool = False
    short: Optional[str] = None  # a one-letter spelling, listed first (``-m``)

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every spelling the command line accepts, without repeats."""
        short = [self.short] if self.short else []
        return tuple(dict.fromkeys([*short, f"--{self.name}", f"--{self.name.replace('_', '-')}"]))


# In --help order. parse_args resolves the None defaults (see _resolve_defaults).
OPTIONS: tuple[Option, ...] = (
    Option("nproc_per_node",
           "worker processes on this node: a number, or as torchrun auto (one per GPU, else one "
           "per CPU core), cpu, gpu (default 1)"),
    Option("server_num", "parameter-server job: number of server processes (with --worker_num; over "
           "--nnodes, workers first, an equal share per node)", type=int),
    Option("worker_num", "parameter-server job: number of worker processes (with --server_num)", type=int),
    Option("nnodes", "number of nodes (default 1)", type=int, default=1),
    Option("node_rank", "rank of this node, 0..nnodes-1 (default 0)", type=int, default=0),
    Option("master_addr", "address of node 0; its rendezvous store listens there only (default 127.0.0.1)"),
    Option("master_port", "port of the rendezvous store on node 0 (default 29500)", type=int),
    Option("local_addr", "address of this node for the workers' gloo connections (default: "
           "--master_addr on node 0, else the address this machine's hostname resolves to)"),
    Option("standalone", "one node, rendezvous on a free local port (as torchrun; overrides "
           "--master_addr/port)", flag=True),
    Option("log_dir",
           f"directory for the workerlog.<rank> files; only one job at a time may write into it "
           f"(default: a new {DEFAULT_LOG_ROOT}/<run id>/ per job, {DEFAULT_LOG_ROOT}/{LATEST_LINK} links to it)"),
    Option("max_restarts", "restarts of the worker group before giving up (default 0)", type=int, default=0),
    Option("rdzv_timeout", "seconds to wait for the other nodes (default: GLOBALTENSOR_TIMEOUT, else 300)",
           type=float),
    Option("module", "run the target as a module, like python -m", flag=True, short="-m"),
    Option("start_method", "forkserver (default: workers are forked from a copy of the launcher, "
           "which imported torch already, and start in milliseconds) or spawn (a fresh interpreter "
           "per worker, as torchrun: for a script that sets environment variables before importing "
           "torch)", default="forkserver"),
)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``OPTIONS`` (plus ``--version`` and the script).

    >>> build_parser().prog
    'python -m globaltensor.launch'
    """
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Launch a distributed globaltensor/torch.distributed job "
        "(one process per local rank) via torch.distributed.elastic.",
        allow_abbrev=False,  # never swallow a script option as an abbreviation
    )
    for option in OPTIONS:
        kind = {"action": "store_true"} if option.flag else {"type": option.type, "default": option.default}
        p.add_argument(*option.spellings, dest=option.name, help=option.help, **kind)
    p.add_argument("--version", action="version", version=version_line())
    p.add_argument("script", nargs="?", help="script path (or module name with -m)")
    # Only for --help: parse_args() hands everything after the script over untouched.
    p.add_argument("script_args", nargs="*", help="arguments for the script (even ones like --nnodes)")
    return p


def version_line() -> str:
    """``globaltensor <version> (torch <version>)``, what ``--version`` prints."""
    import torch

    from .. import __version__
    return f"globaltensor {__version__} (torch {torch.__version__})"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate the command line; exits with a one-line message if invalid.

    >>> parse_args(["--nproc_per_node", "2", "train.py", "--lr", "0.1"]).script_args
    ['--lr', '0.1']
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, script_args = _split_at_script(argv)
    args = build_parser().parse_args(ours)
    args.script_args = script_args
    _resolve_defaults(args)
    for message in _problems(args):
        fail(message)
    return args


def _split_at_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's arguments up to and including the script, the script's arguments).

    We split ourselves: argparse's REMAINDER drops a "--" the script may expect. Every
    option takes one value (``--opt value`` or ``--opt=value``) except the flags."""
    flags = {"-h", "--help", "--version", *(s for option in OPTIONS if option.flag for s in option.spellings)}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 1 if ("=" in argv[i] or argv[i] in flags) else 2
    i += argv[i:i + 1] == ["--"]  # "launch [opts] -- script.py": skip the separator
    return argv[:i + 1], argv[i + 1:]


def _resolve_defaults(args: argparse.Namespace) -> None:
    """Fill in what the command line left to the launcher: the local world size, the
    master endpoint, the rendezvous timeout and the parameter-server roles."""
    from ..env import timeout_seconds

    args.nproc_per_node = _local_world_size(args.nproc_per_node)
    _set_master_endpoint(args)
    if args.local_addr is None and args.node_rank == 0:
        args.local_addr = args.master_addr  # node 0 is where master_addr points
    if args.rdzv_timeout is None:
        try:
            args.rdzv_timeout = timeout_seconds()
        except ValueError as e:
            fail(str(e))
    _set_ps_roles(args)
    if args.nproc_per_node is None:
        args.nproc_per_node = 1


def _problems(args: argparse.Namespace) -> list[str]:
    """Every reason the parsed command line cannot start a job, in the order reported."""
    log_dir = DEFAULT_LOG_ROOT if args.log_dir is None else args.log_dir  # the default's parent
    checks = [
        (args.script is None, f"no script given ({USAGE_HINT})"),
        (args.nproc_per_node < 1, f"--nproc_per_node must be >= 1, got {args.nproc_per_node}"),
        (args.nnodes < 1, f"--nnodes must be >= 1, got {args.nnodes}"),
        (not 0 <= args.node_rank < args.nnodes,
         f"--node_rank must be in [0, {args.nnodes}), got {args.node_rank}"),
        (not args.standalone and not 1 <= args.master_port <= 65535,
         f"--master_port must be in 1..65535, got {args.master_port}"),
        (args.max_restarts < 0, f"--max_restarts must be >= 0, got {args.max_restarts}"),
        (args.start_method not in START_METHODS,
         f"--start_method must be one of {', '.join(START_METHODS)}, got {args.start_method!r}"),
        (not args.rdzv_timeout > 0, f"--rdzv_timeout must be > 0 seconds, got {args.rdzv_timeout}"),
        (os.path.islink(log_dir),
         f"--log_dir {log_dir!r} is a symbolic link; refusing to write worker logs through it"),
        (os.path.isfile(log_dir), f"--log_dir {log_dir!r} is a file, not a directory"),
        (args.script is not None and not args.module and not os.path.isfile(args.script),
         f"script not found: {args.script!r}"),
    ]
    for rank in node_ranks(args) if args.log_dir is not None else ():  # a new run dir is empty
        path = worker_log(args.log_dir, rank, args.ps)
        checks.append((os.path.islink(path),
                       f"{path} is a symbolic link; refusing to write the worker log through it"))
    return [message for bad, message in checks if bad]


def _set_ps_roles(args: argparse.Namespace) -> None:
    """``args.ps`` = (servers, workers) for a parameter-server job, else None."""
    args.ps = None
    if args.server_num is None and args.worker_num is None:
        return
    servers, workers = args.server_num, args.worker_num
    if servers is None or workers is None:
        fail("--server_num and --worker_num go together (a parameter-server job needs both)")
    if servers < 1 or workers < 1:
        fail(f"--server_num and --worker_num must be >= 1, got {servers} and {workers}")
    # The job's roles go by global rank (workers first), so on several nodes the first
    # nodes run the workers and the last ones the servers, an equal share each.
    total = servers + workers
    if total % max(args.nnodes, 1):
        fail(f"--server_num {servers} + --worker_num {workers} = {total} processes do not split "
             f"evenly over --nnodes {args.nnodes}")
    per_node = total // max(args.nnodes, 1)
    if args.nproc_per_node not in (None, per_node):
        fail(f"--nproc_per_node {args.nproc_per_node} disagrees with --server_num {servers} + "
             f"--worker_num {workers} over --nnodes {args.nnodes}; leave it out")
    args.nproc_per_node, args.ps = per_node, (servers, workers)


def _local_world_size(value: Optional[str]) -> Optional[int]:
    """--nproc_per_node as torchrun reads it: a number, ``auto`` (one process per GPU when
    there are GPUs, else one per CPU core), ``cpu`` or ``gpu``."""
    if value is None:
        return None
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(value)
    except ValueError as e:
        fail(f"--nproc_per_node {value!r}: {e} (expected a number, auto, cpu or gpu)")


def _set_master_endpoint(args: argparse.Namespace) -> None:
    """Fill in the master endpoint; with --standalone, a free port on 127.0.0.1 (port 0
    here: the job binds the socket and reads the port the system chose)."""
    args.master_ignored = []
    if not args.standalone:
        args.master_addr = "127.0.0.1" if args.master_addr is None else args.master_addr
        args.master_port = 29500 if args.master_port is None else args.master_port
        return
    if args.nnodes != 1:
        fail(f"--standalone runs a single node; it conflicts with --nnodes {args.nnodes}")
    # torchrun's --standalone overrides the endpoint too; the banner says they were ignored.
    args.master_ignored = [f"--{name}" for name in ("master_addr", "master_port") if getattr(args, name) is not None]
    args.master_addr, args.master_port = "127.0.0.1", 0


def node_ranks(args: argparse.Namespace) -> range:
    """The global ranks of this node's workers.

    >>> node_ranks(argparse.Namespace(node_rank=1, nproc_per_node=2))
    range(2, 4)
    """
    first = args.node_rank * args.nproc_per_node
    return range(first, first + args.nproc_per_node)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``globaltensor.launch: error: <message>`` and exit (2: a bad command line;
    1: a problem found while starting the job)."""
    say(f"error: {message}")
    sys.exit(code)
