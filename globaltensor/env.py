"""Who we are in the world, read from the launcher's environment.

This module reads variables only; ``comm`` turns them into process groups. It sits
below ``placement`` so that a placement can check its ranks against the world size
without any communication.

A setting read from the environment when globaltensor is imported is registered with
``read_at_import``: the launcher's fork server imports globaltensor before it knows a
worker's environment and runs every such reader again in each worker (``reread``).
"""
from __future__ import annotations

import os
from typing import Callable

_READ_AT_IMPORT: list = []


def read_at_import(read: Callable[[], None]) -> Callable[[], None]:
    """Run ``read`` (it turns environment variables into settings) now, and again at each
    ``reread``; usable as a decorator.

    >>> @read_at_import
    ... def _read_my_variable(): ...
    """
    _READ_AT_IMPORT.append(read)
    read()
    return read


def reread() -> None:
    """Apply this process's environment to every setting read at import (a worker forked
    from a process that imported globaltensor with another environment)."""
    for read in _READ_AT_IMPORT:
        read()


def _int_var(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def get_rank() -> int:
    """This process's global rank (0 in a world of one)."""
    return _int_var("RANK", 0)


def get_world_size() -> int:
    """Number of processes in the job (1 without a launcher)."""
    return _int_var("WORLD_SIZE", 1)


def get_local_rank() -> int:
    """This process's rank on its node (selects the cuda device)."""
    return _int_var("LOCAL_RANK", 0)


def _seconds_var(name: str, default: str) -> float:
    value = os.environ.get(name, default)
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return seconds


def timeout_seconds() -> float:
    """Collective timeout, ``GLOBALTENSOR_TIMEOUT`` seconds (default 300)."""
    return _seconds_var("GLOBALTENSOR_TIMEOUT", "300")


def read_timeout_seconds() -> float:
    """How long the ranks of a read that communicates (``x.item()`` of a split tensor)
    wait for each other before it fails: ``GLOBALTENSOR_READ_TIMEOUT`` seconds
    (default 10). A read called on some ranks only then fails in seconds, not after
    the collective timeout; a rank that reaches the read later than this fails too."""
    return _seconds_var("GLOBALTENSOR_READ_TIMEOUT", "10")


def local_addr() -> str | None:
    """The address this process's gloo groups use (``GLOBALTENSOR_LOCAL_ADDR``, set by
    the launcher's ``--local_addr``); None: the address of the hostname, torch's default."""
    return os.environ.get("GLOBALTENSOR_LOCAL_ADDR") or None


def debug_enabled() -> bool:
    return os.environ.get("GLOBALTENSOR_DEBUG", "") not in ("", "0")
