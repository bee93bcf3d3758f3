"""sbp signature rules, one file per op family: this index imports every family file,
whose registrations (``registry.py``) the dispatcher looks up.

A rule takes a ``Call`` (``propagation/call.py``) and returns the 1-D signatures valid on
one placement axis: a list of ``(input sbps, output sbps)``, one sbp per GlobalTensor
input and one per tensor output; the dispatcher asks once per axis. The few rules whose
signatures differ by axis are registered with ``per_axis=True`` and take the axis too
(``registry.py``). The dispatcher combines them across axes and picks the cheapest.
Shared pieces: ``sbp.candidates`` (the sbp one tensor may take on an axis),
``_dims.normalize_dim`` (a dim argument wrapped as torch wraps it). A rule itself does
not communicate; local implementations and decompositions may (the index range checks
reduce a flag, decompositions box through ``to_global``, value reads gather).
"""
from . import (  # noqa: F401
               along_dim,
               attention,
               attention_scores,
               complex,
               conv,
               data_dependent,
               einsum,
               embedding,
               fast_path,
               foreach,
               functional,
               indexing,
               join,
               like,
               linalg,
               losses,
               matmul,
               norm,
               optim,
               out_variant,
               pointwise,
               random,
               reduction,
               resample,
               softmax,
               values,
               view,  # (registration)
)
