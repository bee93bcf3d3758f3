"""The worker side of table checkpoints: what ``EmbeddingTable.get_extra_state``
returns and ``set_extra_state`` takes, for ``get_state_dict`` + ``dcp.save`` /
``dcp.load`` + ``set_state_dict``.

- A row table: its rows and their optimizer state as GlobalTensors split by rows
  over the workers (each worker pulls its block), so DCP writes them in global row
  order and a job with any number of servers and workers loads them.
- A hashed table has no row numbers and holds a different number of rows on each
  server, so its rows go by id into ``PARTS`` fixed parts (``hashed.part_of``), each
  a ``HashedRows`` object: worker w saves and loads the parts p with
  ``p % workers == w``, whatever the numbers of servers and workers, and on loading
  sends each row to the server its id hashes to. DCP stores the parts as objects
  (no fixed tensor shape to agree on). The count filter's sightings of ids not yet
  admitted are not kept: they start again from zero.

Every worker calls both (they meet: the blocks are of one moment in async and geo
mode, and no worker trains before every block is loaded).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .. import comm
from ..factory import from_local
from ..layout import balanced_split
from ..placement import placement
from ..sbp import split
from ..tensor import is_global
from . import server
from .hashed import HashedRows, part_of, server_of
from .runtime import state, wait_calls

# `rows` below is a table's ``table.Rows`` (not imported: table.py imports this module)
Rows = Any

__all__ = ["PARTS", "workers_meet", "row_state", "load_row_state", "hashed_state", "load_hashed_state"]

# Parts of a hashed table's checkpoint: up to this many workers save and load in parallel.
PARTS = 64
_COUNTS = ("admitted", "evicted", "filtered")


def workers_meet() -> None:
    """A barrier of the workers (a collective of their group; servers take no part)."""
    comm.barrier(tuple(range(state.workers)))


def _workers_placement():  # type: ignore[no-untyped-def]
    return placement("cpu", ranks=list(range(state.workers)))


def _block(rows: Rows) -> torch.Tensor:
    """The rows of a row table this worker saves and loads."""
    offset, size = balanced_split(rows.num_rows, state.workers)[state.rank]
    return torch.arange(offset, offset + size)


def row_state(rows: Rows) -> dict:
    """{"weight": ..., "optimizer.<name>": ...}: GlobalTensors split by rows over the workers."""
    ids = _block(rows)
    values, opt_state = rows.read(ids)
    return {name: from_local(t, placement=_workers_placement(), sbp=split(0),
                                shape=(rows.num_rows, t.shape[1]))
            for name, t in [("weight", values), *((f"optimizer.{n}", t) for n, t in opt_state.items())]}


def load_row_state(rows: Rows, saved: dict) -> None:
    """Push ``row_state``'s form (filled by ``dcp.load``; plain whole tensors work too)."""
    ids = _block(rows)

    def block(t: torch.Tensor) -> torch.Tensor:
        if is_global(t):
            return t.to_global(placement=_workers_placement(), sbp=split(0)).to_local()
        return t[ids[0]:ids[0] + ids.numel()] if ids.numel() else t[:0]

    weight = saved.get("weight")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (rows.num_rows, rows.dim):
        raise ValueError(f"table {rows.name!r}: a checkpoint of a {rows.num_rows} x {rows.dim} table "
                         f"expected, got {_describe(saved)}")
    prefix = "optimizer."
    rows.write(ids, block(weight), {k[len(prefix):]: block(v) for k, v in saved.items() if k.startswith(prefix)})


def _my_parts() -> list[int]:
    return [p for p in range(PARTS) if p % state.workers == state.rank]


def hashed_state(rows: Rows) -> dict:
    """{"hashed_parts": {"07": HashedRows, ...}}: this worker's parts, rows sorted by id;
    part "00" (always worker 0's) also carries the table's counts."""
    mine = _my_parts()
    answers = wait_calls([rows.call(s, "checkpoint read", server.read_hashed, (rows.id, torch.tensor(mine), PARTS))
                          for s in range(state.servers)])
    held = HashedRows.cat(answers)
    held = held.select(torch.argsort(held.ids))
    part = part_of(held.ids, PARTS)
    parts = {f"{p:02d}": held.select(part == p) for p in mine}
    if state.rank == 0:
        each = wait_calls([rows.call(s, "stats", server.stats, (rows.id,)) for s in range(state.servers)])
        counts = {k: sum(d[k] for d in each) for k in (*_COUNTS, "rows")}
        parts["00"] = replace(parts["00"], counters=counts)
    return {"hashed_parts": parts}


def load_hashed_state(rows: Rows, saved: dict) -> None:
    """Replace the table's rows by ``hashed_state``'s parts (filled by ``dcp.load``):
    each row goes to the server its id hashes to now."""
    parts = saved.get("hashed_parts")
    names = [f"{p:02d}" for p in _my_parts()]
    if not isinstance(parts, dict) or any(not isinstance(parts.get(n), HashedRows) for n in names):
        raise ValueError(f"table {rows.name!r} is hashed: a checkpoint of a hashed table (parts "
                         f"{names[:3]}...) expected, got {_describe(saved)}")
    got = [parts[n] for n in names]
    if any(r.values.dim() != 2 or r.values.shape[1] != rows.dim for r in got):
        raise ValueError(f"table {rows.name!r}: rows of dim {rows.dim} expected, got "
                         f"{sorted({tuple(r.values.shape[1:]) for r in got})}")
    workers_meet()  # nobody reads the table any more
    if state.rank == 0:
        wait_calls([rows.call(s, "checkpoint load", server.clear_hashed, (rows.id,)) for s in range(state.servers)])
    workers_meet()  # every server is empty before any row arrives
    loaded = HashedRows.cat(got) if got else None
    calls = []
    if loaded is not None and len(loaded):
        owner = server_of(loaded.ids, state.servers)
        calls = [rows.call(s, "checkpoint load", server.write_hashed, (rows.id, loaded.select(owner == s)))
                 for s in range(state.servers) if bool((owner == s).any())]
    counts = parts[names[0]].counters if state.rank == 0 else None
    if counts is not None:
        # the servers counted the loaded rows as admitted; the rest of the history:
        extra = {"admitted": counts["admitted"] - counts["rows"], "evicted": counts["evicted"],
                 "filtered": counts["filtered"]}
        calls.append(rows.call(0, "checkpoint load", server.add_counts, (rows.id, extra)))
    wait_calls(calls)


def _describe(saved: object) -> str:
    if not isinstance(saved, dict):
        return type(saved).__name__
    return str({k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for k, v in saved.items()})
