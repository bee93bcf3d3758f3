"""Who we are in the world, read from the launcher's environment, and every
``GLOBALTENSOR_*`` variable globaltensor reads (``VARIABLES``; the table of them is
docs/environment.md).

This module reads variables only; ``comm`` turns them into process groups. It sits
below ``placement`` so that a placement can check its ranks against the world size
without any communication. The one other reader is the launcher's worker bootstrap
(``launch/boot.py``), which imports only the standard library.

A setting read from the environment when globaltensor is imported is registered with
``read_at_import``: the launcher's fork server imports globaltensor before it knows a
worker's environment and runs every such reader again in each worker (``reread``).
"""
from __future__ import annotations

import math
import os
from typing import Callable

_READ_AT_IMPORT: list = []

# Every GLOBALTENSOR_* variable: name -> (default, meaning). docs/environment.md has the
# same table (tests/core/test_environment.py compares them, and checks that the package
# reads these variables here only).
VARIABLES = {
    "GLOBALTENSOR_TIMEOUT": (
        "300", "seconds a collective waits for its peers before it fails; also the "
        "launcher's default --rdzv_timeout"),
    "GLOBALTENSOR_READ_TIMEOUT": (
        "10", "seconds the ranks of a read that communicates (x.item() of a split tensor) "
        "wait for each other before it fails"),
    "GLOBALTENSOR_DEBUG": (
        "unset (off)", "1: log every boxing route, and check mode (check_consistency) "
        "everywhere; read at import"),
    "GLOBALTENSOR_LOCAL_ADDR": (
        "unset", "the address this process's gloo groups use (set by the launcher from "
        "--local_addr, whose default on node 0 is --master_addr); unset: torch's default, "
        "the address the hostname resolves to; read at import"),
    "GLOBALTENSOR_TORCH_ADVICE": (
        "1", "0: no import hook, and torch's fully_shard, parallelize_module and DTensor's "
        "dispatcher are left unwrapped (no advice when they meet a GlobalTensor), and "
        "get_state_dict's full_state_dict=True leaves GlobalTensors as they are; read "
        "at import"),
    "GLOBALTENSOR_PLAN_STEPS": (
        "1", "0: turn whole-step planning (record and replay of a step's decisions) off; "
        "read at import"),
    "GLOBALTENSOR_FINGERPRINTS": (
        "1", "0: collectives carry no fingerprint (their op, program line and number in "
        "the group, compared on arrival: ranks at different collectives raise "
        "DivergenceError instead of mixing values); the same on every rank; read at import"),
    "GLOBALTENSOR_TRIM_HEAP": (
        "1", "0: fully_shard leaves malloc's mmap threshold and MKL's buffers alone"),
    "GLOBALTENSOR_CHECK_TIMES": (
        "unset", "a file: rank 0 of every gt.testing.World appends a line per check (its "
        "seconds, world size and name)"),
    "GLOBALTENSOR_LAUNCHER_PID": (
        "set by the launcher", "the launcher's (or its fork server's) pid: workers die with "
        "it; its presence means \"under our launcher\""),
    "GLOBALTENSOR_PS_SERVER_NUM": (
        "set by the launcher", "parameter-server job: number of server processes "
        "(--server_num)"),
    "GLOBALTENSOR_PS_WORKER_NUM": (
        "set by the launcher", "parameter-server job: number of worker processes "
        "(--worker_num)"),
    "GLOBALTENSOR_PS_ROLE": (
        "set by the launcher", "parameter-server job: this process's role, server or worker"),
    "GLOBALTENSOR_PS_RANK": (
        "set by the launcher", "parameter-server job: this process's rank within its role"),
}


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
    """A number of seconds: finite and > 0 (unset or empty: ``default``). ``inf``,
    ``nan``, zero, negative numbers and non-numbers raise a ValueError naming the
    variable, its value and what is allowed (torch's timeouts are timedeltas: an
    infinite one overflows deep inside process-group creation)."""
    value = os.environ.get(name) or default
    try:
        seconds = float(value)
    except ValueError:
        seconds = None
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"environment variable {name}={value!r} is not allowed: it must be "
                         f"a finite number of seconds > 0 (default {default}); unset it for "
                         f"the default")
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


def _flag(name: str, default: bool) -> bool:
    """A switch: unset or empty is ``default``, "0" is off, anything else on."""
    value = os.environ.get(name, "")
    return default if value == "" else value != "0"


def debug_enabled() -> bool:
    """``GLOBALTENSOR_DEBUG=1``: boxing logged, check mode on (default off)."""
    return _flag("GLOBALTENSOR_DEBUG", False)


def torch_advice_enabled() -> bool:
    """Whether torch's FSDP2/TP/DTensor entry points are wrapped to refuse GlobalTensors
    with advice, and DCP's full state dicts to take them (an import hook):
    ``GLOBALTENSOR_TORCH_ADVICE``, default on."""
    return _flag("GLOBALTENSOR_TORCH_ADVICE", True)


def plan_steps_enabled() -> bool:
    """Whole-step planning: ``GLOBALTENSOR_PLAN_STEPS``, default on."""
    return _flag("GLOBALTENSOR_PLAN_STEPS", True)


def fingerprints_enabled() -> bool:
    """Whether every collective carries a fingerprint checked on arrival
    (``GLOBALTENSOR_FINGERPRINTS``, default on; comm/fingerprint.py)."""
    return _flag("GLOBALTENSOR_FINGERPRINTS", True)


def trim_heap_enabled() -> bool:
    """Whether fully_shard fixes malloc's mmap threshold (``GLOBALTENSOR_TRIM_HEAP``,
    default on)."""
    return os.environ.get("GLOBALTENSOR_TRIM_HEAP", "1") != "0"


def check_times_file() -> str | None:
    """``GLOBALTENSOR_CHECK_TIMES``: where test worlds append each check's time."""
    return os.environ.get("GLOBALTENSOR_CHECK_TIMES") or None


def under_launcher() -> bool:
    """True in a process started by globaltensor's launcher (``GLOBALTENSOR_LAUNCHER_PID``)."""
    return bool(os.environ.get("GLOBALTENSOR_LAUNCHER_PID"))


def ps_role() -> str | None:
    """``GLOBALTENSOR_PS_ROLE`` ("server" / "worker"; None outside a parameter-server job)."""
    return os.environ.get("GLOBALTENSOR_PS_ROLE")


def ps_count(name: str) -> int | None:
    """A parameter-server job's number, ``GLOBALTENSOR_PS_<name>`` (RANK, SERVER_NUM,
    WORKER_NUM); None when unset."""
    var = f"GLOBALTENSOR_PS_{name}"
    if var not in VARIABLES:
        raise KeyError(f"{var} is not one of globaltensor's variables")
    value = os.environ.get(var)
    return None if value is None else int(value)
