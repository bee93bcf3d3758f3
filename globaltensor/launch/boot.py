"""The first code of every worker process: prepare the process, then run the target in
it as ``python [-m] target args`` would.

The agent starts ``python -u <this file> [-m] target args`` (``--start_method spawn``;
by default the fork server runs ``main`` in a forked copy of the launcher as if it had,
see ``forkserver``): run as a file, not with ``-m globaltensor.launch.boot``, so that a
spawned worker imports neither globaltensor nor torch before its script asks for them.
It imports only the standard library (the directory of this file is ``sys.path[0]``
until the target's replaces it; none of the launcher's module names is a standard
library one). The launcher sets ``GLOBALTENSOR_LAUNCHER_PID`` and, in a
parameter-server job, ``GLOBALTENSOR_PS_WORKER_NUM``.

What it does, in order, and why:

- Linux: asks for SIGKILL when the launcher dies (even a SIGKILLed launcher leaves no
  orphaned workers), and exits if the launcher died before that took effect;
- sends stderr into stdout: one log per rank, both streams in the order written;
- on SIGTERM (the launcher stopping this rank because a peer failed) prints every
  thread's stack before ending: a rank stuck outside a collective shows where it is;
- in a parameter-server job, sets ``GLOBALTENSOR_PS_ROLE`` / ``GLOBALTENSOR_PS_RANK``;
- runs the target; an uncaught exception is printed without this file's and runpy's
  frames and without torch's second ``[rankN]:`` prefix, and exits with code 1.

Example (what the agent runs for ``launch ... -m mypkg.train --lr 0.1``)::

    python -u .../globaltensor/launch/boot.py -m mypkg.train --lr 0.1
"""

import os
import sys


def main() -> None:
    """Prepare this worker process, then run ``sys.argv[1:]`` (``[-m] target args``)."""
    _die_with_launcher()
    os.dup2(1, 2)  # one log per rank, stdout and stderr in the order written
    _dump_stacks_on_sigterm()
    _set_ps_role()
    as_module = sys.argv[1] == "-m"
    target = sys.argv[2] if as_module else sys.argv[1]
    sys.argv = sys.argv[2:] if as_module else sys.argv[1:]
    try:
        _run(target, as_module)
    except SystemExit:
        raise
    except BaseException as e:
        _print_exception(e)
        sys.exit(1)


def _die_with_launcher() -> None:
    """Die with the launcher, even when it is SIGKILLed: no orphaned workers (Linux).
    A worker forked by the launcher's fork server dies with that server, which dies with
    the launcher (``GLOBALTENSOR_LAUNCHER_PID`` then names the server)."""
    _die_with_parent(int(os.environ["GLOBALTENSOR_LAUNCHER_PID"]))


def _die_with_parent(parent: int) -> None:
    """Get SIGKILL when ``parent`` (this process's parent) dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(1)  # the parent died before prctl took effect


def _dump_stacks_on_sigterm() -> None:
    """When the launcher stops this rank (a peer failed), print where it was: a rank
    stuck outside a collective is then visible. chain=True still terminates."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    # Forked children (DataLoader workers, ...) are routinely ended by SIGTERM: no dumps from them.
    os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))


def _set_ps_role() -> None:
    """In a parameter-server job, global ranks below W are the workers, the rest servers."""
    workers = os.environ.get("GLOBALTENSOR_PS_WORKER_NUM")
    if workers is None:
        return
    rank, workers = int(os.environ["RANK"]), int(workers)
    os.environ["GLOBALTENSOR_PS_ROLE"] = "worker" if rank < workers else "server"
    os.environ["GLOBALTENSOR_PS_RANK"] = str(rank if rank < workers else rank - workers)


def _run(target: str, as_module: bool) -> None:
    """Run ``target`` as ``__main__``, with the ``sys.path[0]`` python would give it."""
    import runpy

    if as_module:
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def _print_exception(e: BaseException) -> None:
    """Print an uncaught exception as python would, starting at the target's frames.

    torch.distributed wraps sys.excepthook to prefix "[rankN]: "; the launcher prefixes
    console lines already, so print through the hook it wrapped."""
    hook = sys.excepthook
    while getattr(hook, "__name__", "") == "_distributed_excepthook":
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__))
        hook = cells["old_hook"].cell_contents
    tb = e.__traceback__  # without this file's and runpy's frames
    while tb is not None and (tb.tb_frame.f_globals is globals()
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    hook(type(e), e.with_traceback(tb), tb)


if __name__ == "__main__":
    main()
