"""The launcher's rendezvous: torchrun's static one, with node 0's store bound to
``--master_addr`` only and nodes that say what they wait for.

Node 0's launcher binds the store's socket itself (``listen``) before anything starts,
so a busy port or a foreign ``--master_addr`` is a one-line error, and hands it to
torch's ``TCPStore(master_listen_fd=...)``: the store then listens on that address
only, not on every interface (anyone who reaches the store can write into the job).
Every node then waits up to ``--rdzv_timeout`` seconds for the others, naming the
missing ``node_rank`` when it gives up.

Workers build their process group in a store too (torch's "agent store": MASTER_PORT).
The first attempt's workers use node 0's store itself; every restart gets a new, empty
store on a new port of ``--master_addr`` (node 0 opens it and publishes the port to the
other nodes), because a restarted worker reading the previous attempt's keys connects to
a dead peer's address (gloo: "Connection refused") or waits on a stale barrier count.

Example::

    sock = listen("127.0.0.1", 29500)    # node 0, before the agent starts
    rendezvous_handler_registry.register(RDZV_BACKEND, create_rendezvous)
"""

from __future__ import annotations

import datetime
import errno
import socket
import time
from typing import Any, Optional

from .logs import LaunchError, say

__all__ = ["RDZV_BACKEND", "RUN_ID", "create_rendezvous", "listen", "rendezvous_class", "wait_for_listener"]

# Same id on every node: the rendezvous prefixes its TCPStore keys with it.
RUN_ID = "globaltensor"
# Our rendezvous backend's name in torch's handler registry (see create_rendezvous).
RDZV_BACKEND = "globaltensor-static"


def listen(addr: str, port: int, option: str = "--master_addr") -> socket.socket:
    """A socket listening on ``addr:port`` only (the rendezvous store's, on node 0).

    Raises LaunchError, naming the option to change (``option`` gave ``addr``), when
    that cannot be.

    >>> listen("127.0.0.1", 0).getsockname()[0]  # doctest: +SKIP
    '127.0.0.1'
    """
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((addr, port), family=family, backlog=1024)
    except socket.gaierror as e:
        raise LaunchError(f"{option} {addr!r} does not resolve ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise LaunchError(f"--master_port {port} is already in use on {addr} (another job, or one "
                              f"still exiting?): choose another --master_port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            where = "run node_rank 0 on the machine it names" if option == "--master_addr" else "give one of its own"
            raise LaunchError(f"{option} {addr} is not an address of this machine: {where}") from None
        raise LaunchError(f"cannot listen on {addr}:{port}: {e.strerror}") from None


def wait_for_listener(addr: str, port: int, deadline: float) -> Optional[str]:
    """Connect to ``addr:port`` until something listens there or ``deadline`` (a
    ``time.monotonic()`` value) passes; None when it listens, else why not.

    >>> wait_for_listener("127.0.0.1", 1, time.monotonic() + 0.5)  # doctest: +SKIP
    'connection refused'
    """
    reason = "nothing listens there"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return reason
        try:
            socket.create_connection((addr, port), timeout=min(left, 5.0)).close()
            return None
        except socket.gaierror as e:
            return f"{addr!r} does not resolve ({e.strerror})"
        except OSError as e:
            reason = (e.strerror or str(e) or type(e).__name__).lower()
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))  # a retry of a refused connect


def create_rendezvous(params: Any) -> Any:
    """torch's RendezvousHandler registry calls this with our LaunchConfig's rdzv settings
    (``rank``, ``timeout`` and node 0's ``listen_socket`` in ``params.config``)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    addr, port = parse_rendezvous_endpoint(params.endpoint, -1)
    cfg = params.config
    return rendezvous_class()(addr, port, int(cfg["rank"]), params.max_nodes, params.run_id,
                              float(cfg["timeout"]), cfg.get("listen_socket"))


def rendezvous_class() -> type:
    """``_NodeRendezvous`` on torch's StaticTCPRendezvous (imported here, not at module
    import: ``--help`` and bad arguments never load the elastic agent)."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    return type("_Rendezvous", (_NodeRendezvous, StaticTCPRendezvous), {})


class _NodeRendezvous:
    """torchrun's static rendezvous, with a store we open ourselves: node 0's listens
    on the socket the launcher bound to master_addr (TCPStore's master_listen_fd),
    and every node says what it waits for and gives up after ``timeout`` seconds.

    A mixin: ``rendezvous_class`` puts it before StaticTCPRendezvous, whose attributes
    (``master_addr``, ``rank``, ``world_size``, ``run_id``, ``_store``) it uses."""

    def __init__(self, addr: str, port: int, node_rank: int, nnodes: int, run_id: str,
                 timeout: float, listen_socket: Optional[socket.socket]):
        super().__init__(addr, port, node_rank, nnodes, run_id, int(timeout))  # type: ignore[call-arg]
        self.timeout_s, self.listen_socket, self.round = timeout, listen_socket, 0
        self._attempt_store: Any = None  # node 0: the current restart's workers' store

    def get_backend(self) -> str:
        return RDZV_BACKEND

    def next_rendezvous(self) -> Any:
        if self._store is None:
            self._store = self._open_store()
        self.round += 1
        self._wait_for_nodes()
        info = super().next_rendezvous()  # type: ignore[misc]
        if self.round == 1:
            return info
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        port = self._workers_store_port()
        return RendezvousInfo(info.store, info.rank, info.world_size,
                              RendezvousStoreInfo(self.master_addr, port))

    def _workers_store_port(self) -> int:
        """The port of this restart's new workers' store: node 0 opens it on
        ``master_addr`` (dropping the previous restart's) and publishes the port in the
        rendezvous store under this round's key; the other nodes read it there."""
        key = f"{self.run_id}/workers_store_port/{self.round}"
        if self.rank == 0:
            from torch.distributed import TCPStore

            self._attempt_store = None  # the previous restart's store: its workers are gone
            sock = listen(self.master_addr, 0)
            port = sock.getsockname()[1]
            # The store serves on this descriptor itself (no duplicate): hand it over, so
            # no socket object of ours closes it, or a descriptor reusing its number.
            self._attempt_store = TCPStore(
                self.master_addr, port, self.world_size, True, datetime.timedelta(seconds=self.timeout_s),
                wait_for_workers=False, master_listen_fd=sock.detach())
            self._store.set(key, str(port))
            return port
        return int(self._store.get(key).decode())

    def _open_store(self) -> Any:
        from torch.distributed import TCPStore

        where = f"{self.master_addr}:{self.master_port}"
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.rank == 0:
            return TCPStore(self.master_addr, self.master_port, self.world_size, True, timeout,
                            wait_for_workers=False, master_listen_fd=self.listen_socket.fileno())
        say(f"node {self.rank}: connecting to the rendezvous store of node 0 at {where} "
            f"(up to {self.timeout_s:g} s, --rdzv_timeout)")
        deadline = time.monotonic() + self.timeout_s
        # Wait for node 0's socket ourselves: TCPStore's client, started first, logs a C++
        # stack per failed try and retries past its timeout (2-3x --rdzv_timeout).
        reason = wait_for_listener(self.master_addr, self.master_port, deadline)
        try:
            if reason is None:
                left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0))
                return TCPStore(self.master_addr, self.master_port, self.world_size, False, left)
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LaunchError(f"node {self.rank} could not reach node 0's rendezvous store at {where} "
                          f"within {self.timeout_s:g} s (is node 0's launcher running with this "
                          f"--master_addr/--master_port?): {reason}")

    def _wait_for_nodes(self) -> None:
        key = f"{self.run_id}/nodes_joined/{self.round}"
        self._store.set(f"{key}/{self.rank}", "1")
        joined = self._store.add(key, 1)
        if joined < self.world_size:
            say(f"node {self.rank}: waiting for {self.world_size - joined} more of {self.world_size} "
                f"nodes to join at {self.master_addr}:{self.master_port} "
                f"(up to {self.timeout_s:g} s, --rdzv_timeout)")
        deadline = time.monotonic() + self.timeout_s
        while joined < self.world_size:
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if not self._store.check([f"{key}/{r}"])]
                raise LaunchError(f"timed out after {self.timeout_s:g} s waiting for nodes at "
                                  f"{self.master_addr}:{self.master_port}: {joined} of {self.world_size} "
                                  f"joined; missing node_rank {', '.join(map(str, missing))}")
            time.sleep(0.1)  # a poll of the store, not synchronisation of workers
            joined = self._store.add(key, 0)
