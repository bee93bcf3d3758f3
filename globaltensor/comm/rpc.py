"""Remote calls between processes: a thin layer over ``torch.distributed.rpc`` (TensorPipe).

The parameter-server package (``globaltensor.ps``) talks to its servers through these
functions only; the repository's rule is that nothing outside ``globaltensor/comm``
touches ``torch.distributed``. Every process of the launcher's world joins the RPC
world under the name ``ps<global rank>``, rendezvousing on the launcher's store
(``MASTER_ADDR``/``MASTER_PORT``, the same one the default process group uses; RPC
keeps its keys under its own prefix).

Why RPC and not collectives: a server must answer whichever worker asks, in any
order, without the other workers taking part (async training never waits for a slow
worker). A collective needs every member; an RPC needs only the caller and the callee.

Example (run in every process of a 2-process job)::

    from globaltensor.comm import rpc
    rpc.init(rank, 2)
    if rank == 0:
        print(rpc.call(1, torch.add, (torch.ones(2), 1)))   # tensor([2., 2.])
    rpc.shutdown()
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed.rpc as _rpc

from .. import env

__all__ = ["init", "call", "call_async", "shutdown", "async_execution", "Future",
           "wait_all", "is_initialized"]

Future = torch.futures.Future
# A handler decorated with this returns a Future; the server thread is freed while the
# reply waits (a sync-mode push waits for the other workers without holding a thread).
async_execution = _rpc.functions.async_execution

_initialized = False


def _name(rank: int) -> str:
    return f"ps{rank}"


def is_initialized() -> bool:
    return _initialized


def init(rank: int, world_size: int, threads: int = 8) -> None:
    """Join the RPC world as ``ps<rank>``; blocks until all ``world_size`` joined.

    ``threads``: server threads answering calls in this process (a parameter server
    serves every worker from these).
    """
    global _initialized
    if _initialized:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    opts = _rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=threads,
        rpc_timeout=env.timeout_seconds(),
        # "uv" (TCP) only: shared-memory transports need /dev/shm sizes we cannot assume.
        _transports=["uv"],
        _channels=["basic"],
    )
    with _quiet():
        _rpc.init_rpc(_name(rank), rank=rank, world_size=world_size, rpc_backend_options=opts)
    _initialized = True


def call_async(to: int, fn: Callable, args: Sequence[Any] = ()) -> Future:
    """Run ``fn(*args)`` in process ``to``; returns a Future of its result.

    ``fn`` must be importable by name in the callee (a module-level function): RPC
    pickles it by reference.
    """
    return _rpc.rpc_async(_name(to), fn, args=tuple(args))


def call(to: int, fn: Callable, args: Sequence[Any] = ()) -> Any:
    """``call_async(to, fn, args).wait()``: an exception raised by ``fn`` is re-raised here."""
    return _rpc.rpc_sync(_name(to), fn, args=tuple(args))


def wait_all(futures: Sequence[Future]) -> list:
    """Results of ``futures`` (the first failure is raised)."""
    return [f.wait() for f in futures]


def shutdown(graceful: bool = True, timeout: Optional[float] = None) -> None:
    """Leave the RPC world. ``graceful`` waits until every process calls shutdown and all
    outstanding calls are answered (so no one exits while a peer still talks to it)."""
    global _initialized
    if not _initialized:
        return
    _initialized = False
    with _quiet():
        _rpc.shutdown(graceful=graceful, timeout=0 if timeout is None else timeout)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # RPC's own gloo group triggers torch's "Backend ... as a ProcessGroup is deprecated"
    # warning in every process; it is torch-internal and says nothing to the user.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using a Backend")
        yield
