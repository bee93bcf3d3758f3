"""The models benchmarks/memory.py trains: an MLP, or tp.py's GPT with activation
checkpointing around every block (``torch.utils.checkpoint``, non-reentrant).

>>> spec = Spec("gpt", (768, 8, 12, 8192, 256))     # dim, layers, heads, vocab, block
>>> model = spec.model(); x, y = spec.batch(8); loss = spec.loss(model, x, y)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in backward."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, pins=None):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, use_reentrant=False)


@dataclass(frozen=True)
class Spec:
    """``kind`` "mlp" (``dims``: the widths) or "gpt" (``dims``: dim, layers, heads,
    vocab, block length)."""
    kind: str
    dims: tuple

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        if self.kind == "mlp":
            layers = []
            for a, b in zip(self.dims, self.dims[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
            return torch.nn.Sequential(*layers[:-1])
        from tp import GPT, Config
        dim, layers, heads, vocab, block = self.dims
        model = GPT(Config(vocab=vocab, block=block, dim=dim, heads=heads, layers=layers))
        for i, b in enumerate(model.h):
            model.h[i] = Checkpointed(b)
        return model

    def batch(self, rows: int):
        g = torch.Generator().manual_seed(1)
        if self.kind == "mlp":
            return (torch.randn(rows, self.dims[0], generator=g),
                    torch.randn(rows, self.dims[-1], generator=g))
        vocab, block = self.dims[3], self.dims[4]
        return (torch.randint(0, vocab, (rows, block), generator=g),
                torch.randint(0, vocab, (rows, block), generator=g))

    def loss(self, model, x, y):
        return F.mse_loss(model(x), y) if self.kind == "mlp" else model(x, y)

    def parameters(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.model().parameters())

    def fsdp2_units(self, model) -> list:
        """The modules FSDP2 wraps before the root: each Linear, or each block."""
        if self.kind == "mlp":
            return [m for m in model if isinstance(m, torch.nn.Linear)]
        return list(model.h)

    def marked(self, model) -> list:
        """The modules whose forward and backward the phase table shows."""
        if self.kind == "mlp":
            return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        return list(model.h) + [model.lm_head]

    def describe(self) -> str:
        if self.kind == "mlp":
            return f"MLP {list(self.dims)}"
        dim, layers, heads, vocab, block = self.dims
        return (f"GPT (dim {dim}, {layers} layers, {heads} heads, vocab {vocab}, block "
                f"{block}, activation checkpointing per block)")
