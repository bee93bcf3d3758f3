"""The only code that touches torch.distributed: bootstrap, groups, collectives."""
from .collectives import (
                          all_gather_async,
                          all_gather_into,
                          all_gather_ints,
                          all_gather_p2p,
                          all_gather_p2p_batch,
                          all_reduce_,
                          all_reduce_async,
                          all_to_all_single,
                          barrier,
                          batched_p2p,
                          broadcast_,
                          get_rank,
                          get_world_size,
                          reduce_scatter_into,
                          start_p2p,
                          tracing,
)
from .groups import backend_of, bind_gloo_to_address, finish, get_group, init, local_device
from .guard import (
                          CollectiveError,
                          DivergenceError,
                          activity,
                          agree,
                          check_mode,
                          claim,
                          claims_pending,
                          settle,
)
from .meet import meet
from .stats import CommCounter

__all__ = ["all_gather_async", "all_gather_into", "all_gather_p2p", "all_gather_p2p_batch",
           "all_gather_ints",
           "all_reduce_", "all_reduce_async", "all_to_all_single", "barrier",
           "reduce_scatter_into", "batched_p2p", "broadcast_", "start_p2p", "tracing",
           "get_rank", "get_world_size", "backend_of", "bind_gloo_to_address", "finish",
           "get_group", "init", "local_device", "CommCounter", "CollectiveError",
           "DivergenceError", "activity", "agree", "check_mode", "claim",
           "claims_pending", "settle", "meet"]
