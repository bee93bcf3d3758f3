"""Where globaltensor meets the rest of torch: torch.distributed.checkpoint's tensor-
subclass protocol (``dcp.py``), DTensor conversion (``dtensor.py``), and every change
made to torch itself (``torch_patches.py``, applied when globaltensor is imported)."""
from . import dcp, dtensor, torch_patches

__all__ = ["dcp", "dtensor", "torch_patches"]
