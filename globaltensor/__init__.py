"""globaltensor: declarative global tensors (placement + sbp) on PyTorch.

>>> import globaltensor as gt
>>> p = gt.placement("cpu", ranks=[0])
>>> x = gt.randn(4, 5, placement=p, sbp=gt.sbp.split(0))
>>> y = x.to_global(sbp=gt.sbp.broadcast)
"""
__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)
from . import checkpoint, debug, nn, pipeline, ps, sbp, testing, utils
from .checkpoint import from_dtensor
from .comm import get_rank as _comm_rank
from .comm import get_world_size as _comm_world
from .comm import init
from .dispatch import entry as _dispatch_entry  # noqa: F401  (installs __torch_dispatch__)
from .dispatch import implicit_broadcast
from .env import get_local_rank
from .explicit_mode import LayoutError, explicit
from .factory import arange, empty, from_local, full, normal, ones, rand, randint, randn, tensor, to_global, zeros
from .gradsync import no_sync
from .interop import torch_patches as _torch_patches
from .layout import Layout
from .layout_spec import layout  # hides the module globaltensor.layout as an attribute
from .placement import Placement, placement
from .random import manual_seed
from .tensor import GlobalTensor, is_global

_torch_patches.apply()  # every change globaltensor makes to torch, once


def get_rank() -> int:
    """This process's global rank (initialises the world if needed)."""
    return _comm_rank()


def get_world_size() -> int:
    """Number of processes in the world (initialises the world if needed)."""
    return _comm_world()


matmul = __import__("torch").matmul

__all__ = ["init", "get_rank", "get_world_size", "get_local_rank", "manual_seed", "placement",
           "Placement", "sbp", "GlobalTensor", "is_global", "tensor", "from_local", "to_global",
           "randn", "rand", "randint", "normal", "zeros", "ones", "full", "empty", "arange",
           "matmul", "debug", "nn", "no_sync", "utils", "checkpoint", "from_dtensor",
           "pipeline", "ps", "implicit_broadcast", "explicit", "LayoutError", "layout", "Layout",
           "testing"]
