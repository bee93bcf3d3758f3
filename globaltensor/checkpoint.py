"""``gt.checkpoint``: what to save besides the model for resuming (the random state),
which checkpoint directories are complete, and DTensor conversion.

Checkpoints themselves go through torch.distributed.checkpoint (DCP), which GlobalTensor
answers as a tensor subclass (``interop/dcp.py``): every element is written once, and
a checkpoint loads into any layout, placement or world size.

>>> import torch.distributed.checkpoint as dcp                     # doctest: +SKIP
>>> state = {"model": model.state_dict(), "rng": gt.checkpoint.rng_state()}
>>> dcp.save(state, checkpoint_id="ckpt/step_100")
>>> dcp.load(state, checkpoint_id=gt.checkpoint.latest("ckpt"))
>>> gt.checkpoint.set_rng_state(state["rng"])
"""
from __future__ import annotations

import os

import torch

from .interop.dcp import DCP_HINT
from .interop.dtensor import from_dtensor, to_dtensor
from .random import get_draw, set_draw

__all__ = ["from_dtensor", "to_dtensor", "rng_state", "set_rng_state", "is_complete",
           "latest", "DCP_HINT"]


def rng_state() -> dict:
    """The random state to save with a checkpoint: gt's generator (seed and draw count,
    the same on every rank) and torch's own CPU generator, as plain tensors (DCP saves
    them once and loads them in place).

    >>> state = {"model": model.state_dict(), "rng": gt.checkpoint.rng_state()}  # doctest: +SKIP
    """
    return {"gt": torch.tensor(get_draw(), dtype=torch.int64),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (after ``dcp.load`` filled it in)."""
    torch.set_rng_state(state["torch"])
    # After torch's: torch.set_rng_state may also restore a draw number it carries on
    # the state tensor's Python object, which in a template filled by dcp.load is stale.
    set_draw(tuple(int(v) for v in state["gt"].tolist()))


def is_complete(path: str | os.PathLike) -> bool:
    """True when the DCP checkpoint directory ``path`` was fully written: DCP writes
    its ``.metadata`` last (to a temporary name, then renames it), after every rank's
    data, so a directory without it is a save that crashed."""
    return os.path.isfile(os.path.join(os.fspath(path), ".metadata"))


def latest(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directory under ``root`` (by name order of
    ``step_<n>``-style names, compared numerically), or None.

    >>> gt.checkpoint.latest("ckpt")                                    # doctest: +SKIP
    'ckpt/step_40'
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None

    def key(name: str):
        digits = "".join(ch for ch in name if ch.isdigit())
        return (int(digits) if digits else -1, name)

    done = [n for n in os.listdir(root) if is_complete(os.path.join(root, n))]
    return os.path.join(root, max(done, key=key)) if done else None
