"""sbp signature rules, one file per op family: this index imports every family file,
whose registrations (``registry.py``) the dispatcher looks up.

A rule takes a ``Call`` (``dispatch/call.py``) and a placement axis and returns the 1-D
signatures valid on that axis: a list of ``(input sbps, output sbps)``, one sbp per
GlobalTensor input and one per tensor output. The dispatcher combines them across axes
and picks the cheapest. A rule itself does not communicate; local implementations and
decompositions may (the index range checks reduce a flag, decompositions box through
``to_global``, value reads gather).
"""
from . import (  # noqa: F401
               along_dim,
               attention,
               complex,
               conv,
               data_dependent,
               einsum,
               embedding,
               foreach,
               functional,
               like,
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
