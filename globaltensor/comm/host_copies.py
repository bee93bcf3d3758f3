"""Host stand-ins for a collective's device tensors, where the group's backend lacks the
collective on their device (gloo serves cuda where local ranks share a GPU, and lacks all
but broadcast and all_reduce there): the collective runs on host copies, and the results
are copied back (``collectives._staged`` decides where).
"""
from __future__ import annotations

import torch


class HostCopies:
    """Host stand-ins for a collective's device tensors: ``send`` copies an input in,
    ``receive`` gives an output buffer and ``both`` an in-place one, whose contents
    ``finish`` copies back. The copies are fresh host tensors also for cpu tensors."""

    def __init__(self):
        self._kept: list = []   # inputs' copies: alive until the collective is done
        self._back: list = []   # (device tensor, its host buffer)

    def send(self, t: torch.Tensor) -> torch.Tensor:
        copy = torch.empty(t.shape, dtype=t.dtype).copy_(t)
        self._kept.append(copy)
        return copy

    def receive(self, t: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(t.shape, dtype=t.dtype)
        self._back.append((t, buffer))
        return buffer

    def both(self, t: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(t.shape, dtype=t.dtype).copy_(t)
        self._back.append((t, buffer))
        return buffer

    def finish(self) -> None:
        for t, buffer in self._back:
            t.copy_(buffer)
        self._kept.clear()
        self._back.clear()


class CopiedBack:
    """A started collective on host copies: ``wait()`` waits, then copies back."""

    def __init__(self, work, host: HostCopies):
        self._work, self._host = work, host

    def wait(self) -> None:
        self._work.wait()
        self._host.finish()
