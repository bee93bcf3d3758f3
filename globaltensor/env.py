"""Who we are in the world, read from the launcher's environment, and the RNG state.

This module reads variables only; ``comm`` turns them into process groups. It sits
below ``placement`` so that a placement can check its ranks against the world size
without any communication.
"""
from __future__ import annotations

import os

import torch

# The seed before any gt.manual_seed (torch's default CPU seed, for want of another).
_DEFAULT_SEED = 67280421310721
_seed, _draw = _DEFAULT_SEED, 0


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


def debug_enabled() -> bool:
    return os.environ.get("GLOBALTENSOR_DEBUG", "") not in ("", "0")


def manual_seed(seed: int) -> None:
    """Seed the placement-invariant generator (and torch's own), the same on every rank:
    random values on global tensors are then a function of ``seed``, the draw's number
    (counted from here) and each element's global index.

    >>> import globaltensor as gt
    >>> gt.manual_seed(0)
    """
    global _seed, _draw
    _seed, _draw = int(seed), 0
    torch.manual_seed(int(seed))


def next_draw() -> tuple[int, int]:
    """(seed, draw number) for the next random op; every rank calls it once per random
    op on a global tensor, also ranks outside the op's placement, so counters agree."""
    global _draw
    _draw += 1
    return _seed, _draw


def get_draw() -> tuple[int, int]:
    """The generator's state: (seed, number of draws so far)."""
    return _seed, _draw


def set_draw(state: tuple[int, int]) -> None:
    """Restore a state from ``get_draw`` (activation checkpointing replays draws)."""
    global _seed, _draw
    _seed, _draw = int(state[0]), int(state[1])
