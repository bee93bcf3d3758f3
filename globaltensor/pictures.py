"""Pictures for ``gt.debug``: who holds which block of a tensor (text, ``draw_layout``, or
a PNG, ``plot_layout``) and a step's communication per call (a PNG, ``plot_step``).

They read only layouts and reports: no communication. The PNGs need matplotlib (the
``test`` and ``bench`` extras), imported when a picture is drawn, so the package imports
without it.

>>> print(draw_layout(Layout.make((8,), gt.placement("cpu", [0, 1, 2, 3]), split(0))))  # doctest: +SKIP
dim 0 (8) across
+--------------+--------------+--------------+-------------+
|      0       |      1       |      2       |      3      |
+--------------+--------------+--------------+-------------+
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .layout import Layout, balanced_split
from .sbp import Broadcast, StridedSplit, broadcast, split_dim

if TYPE_CHECKING:
    from .planner.explain import StepReport
    from .tensor import GlobalTensor

__all__ = ["Blocks", "layout_blocks", "draw_layout", "plot_layout", "plot_step"]

# The text picture's box: at most this many characters across and lines down (a
# terminal's character is about twice as tall as wide, so a square tensor is drawn
# twice as wide as tall). More blocks than fit at one character each are not drawn.
MAX_WIDTH, MAX_HEIGHT = 60, 16
MAX_BLOCKS = 30
MAX_PLOTTED = 4096   # blocks in a PNG: more would take minutes and show nothing readable


@dataclass(frozen=True)
class Blocks:
    """What the pictures draw of a layout: the tensor ``dims`` drawn (rows, columns;
    one dim: columns only; none for a scalar), the cut offsets along each (``(0, 1)``
    for an undrawn direction), per block (row, column) the ranks holding it and its
    label, and notes on what the labels mean."""
    dims: tuple
    row_cuts: tuple
    col_cuts: tuple
    holders: tuple
    labels: tuple
    notes: tuple


def layout_blocks(layout: Layout) -> Blocks:
    """The blocks of ``layout``'s first two split dims (or first two dims): the tensor
    cut at every edge of every rank's part, each block with the ranks that hold it.

    >>> layout_blocks(Layout.make((8,), p4, split(0))).labels   # doctest: +SKIP
    (('0', '1', '2', '3'),)
    """
    dims = _drawn_dims(layout)
    axes = (None,) * (2 - len(dims)) + dims     # (row dim, column dim); None: not drawn
    parts = {r: _intervals(layout, r) for r in layout.placement}
    empty = [r for r, per_dim in parts.items() if any(not iv for iv in per_dim)]
    cuts = [(0, 1) if d is None else _cuts(layout.shape[d], [parts[r][d] for r in parts])
            for d in axes]
    holders, labels = [], []
    for row in zip(cuts[0], cuts[0][1:]):
        row_holders = []
        for col in zip(cuts[1], cuts[1][1:]):
            row_holders.append(tuple(r for r in parts if r not in empty and all(
                _covers(parts[r][d], *span) for d, span in zip(axes, (row, col)) if d is not None)))
        holders.append(tuple(row_holders))
        labels.append(tuple(_label(layout, ranks) for ranks in row_holders))
    return Blocks(dims, cuts[0], cuts[1], tuple(holders), tuple(labels),
                  _notes(layout, dims, labels, empty))


def draw_layout(layout: Layout) -> str:
    """A text picture of who holds which block of ``layout``'s tensor: a box (scaled to
    about 60 x 16 characters) cut into blocks, each labelled with its ranks ("0,1":
    copies, "0+1": addends), and notes. Pure: no communication.

    >>> print(draw_layout(Layout.make((8,), gt.placement("cpu", [0, 1]), split(0))))  # doctest: +SKIP
    dim 0 (8) across
    +-----------------------------+----------------------------+
    |              0              |             1              |
    +-----------------------------+----------------------------+
    """
    blocks = layout_blocks(layout)
    if 0 in layout.shape:
        return "\n".join(["(no elements: nothing to draw)", *blocks.notes])
    nr, nc = len(blocks.row_cuts) - 1, len(blocks.col_cuts) - 1
    if max(nr, nc) > MAX_BLOCKS:
        return "\n".join([f"({nr} x {nc} blocks: too many to draw; see each rank's part below)",
                          *blocks.notes])
    widths, heights = _cell_sizes(blocks)
    canvas = _canvas(blocks, widths, heights)
    return "\n".join([_caption(layout, blocks.dims), *canvas, *blocks.notes])


def plot_layout(x: "GlobalTensor | Layout", path: str) -> None:
    """Write a PNG of who holds which block of ``x`` (a GlobalTensor or a Layout): one
    rectangle per block in the colour of its rank (stripes of each rank's colour where
    several hold it, hatched where they hold addends), labelled as ``show_layout``
    labels it. Needs matplotlib. No communication.

    >>> gt.debug.plot_layout(x, "layout.png")      # doctest: +SKIP
    """
    layout = x if isinstance(x, Layout) else getattr(x, "global_layout", None)
    if not isinstance(layout, Layout):
        raise TypeError(f"gt.debug.plot_layout: expected a GlobalTensor or a Layout, got "
                        f"{type(x).__name__}")
    plt = _pyplot()
    blocks = layout_blocks(layout)
    if len(blocks.row_cuts) * len(blocks.col_cuts) > MAX_PLOTTED:
        raise ValueError(f"{layout.shape} with sbp {layout.sbp}: {len(blocks.row_cuts) - 1} x "
                         f"{len(blocks.col_cuts) - 1} blocks, too many to plot (show_layout lists "
                         f"each rank's part)")
    rows, cols = blocks.row_cuts[-1] or 1, blocks.col_cuts[-1] or 1
    aspect = min(max(rows / cols, 0.12), 1.6)   # a thin strip stays readable
    fig, ax = plt.subplots(figsize=(7, 1.9 + 5 * aspect))
    colors = plt.get_cmap("tab20" if layout.placement.size > 10 else "tab10")
    index = {r: i for i, r in enumerate(layout.placement)}
    hatch = "//" if layout.partial_axes else None
    for i, (top, bottom) in enumerate(zip(blocks.row_cuts, blocks.row_cuts[1:])):
        for j, (left, right) in enumerate(zip(blocks.col_cuts, blocks.col_cuts[1:])):
            # a block several ranks hold: thin stripes cycling through their colours, so
            # it reads as one shared block, not as parts
            ranks = blocks.holders[i][j] or (None,)
            n = len(ranks) * (1 if len(ranks) == 1 else max(2, 12 // len(ranks)))
            for k in range(n):
                r = ranks[k % len(ranks)]
                ax.add_patch(plt.Rectangle(
                    (left + k * (right - left) / n, top), (right - left) / n, bottom - top,
                    linewidth=0, hatch=hatch, alpha=0.85,
                    facecolor="white" if r is None else colors(index[r] % colors.N)))
            ax.add_patch(plt.Rectangle((left, top), right - left, bottom - top, fill=False,
                                       edgecolor="black", linewidth=1.5))
            ax.text((left + right) / 2, (top + bottom) / 2, "\n".join(_fit(blocks.labels[i][j], 16, 8)),
                    ha="center", va="center", fontsize=11,
                    bbox={"facecolor": "white", "alpha": 0.85, "linewidth": 0, "pad": 2})
    _layout_axes(ax, layout, blocks, rows, cols)
    title = _header(x, layout)
    ax.set_title(title if len(title) < 90 else title.replace(", sbp", ",\nsbp"), fontsize=9)
    if blocks.notes:
        fig.text(0.01, 0.01, "\n".join(blocks.notes), fontsize=8, va="bottom")
    fig.tight_layout(rect=(0, 0.035 * len(blocks.notes), 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_step(report: "StepReport", path: str, top: int = 30) -> None:
    """Write a PNG of a step's communication (``gt.debug.explain_step``'s report): per
    call that sends bytes, a bar of the bytes its boxings send op by op and one as
    planned, and the estimated time of each; backward calls shaded. The ``top`` calls by
    bytes are drawn, the rest summed into "others". Needs matplotlib.

    >>> report = gt.debug.explain_step(train_step)             # doctest: +SKIP
    >>> gt.debug.plot_step(report, "step.png")
    """
    plt = _pyplot()
    rows = _step_rows(report, top)
    scale, unit = _byte_unit(max([max(r[1], r[2], r[5]) for r in rows], default=1))
    fig, (left, right) = plt.subplots(1, 2, sharey=True, figsize=(11, 2.2 + 0.3 * max(len(rows), 1)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    ys, h = range(len(rows)), 0.38
    for ax, (a, b), what in ((left, (1, 2), unit), (right, (3, 4), "ms")):
        div = scale if ax is left else 1e-3
        ax.barh([y - h / 2 for y in ys], [r[a] / div for r in rows], height=h, color="tab:orange",
                label="op by op")
        ax.barh([y + h / 2 for y in ys], [r[b] / div for r in rows], height=h, color="tab:blue",
                label="planned")
        ax.set_xlabel(f"{'sent by the boxings into the call' if ax is left else 'estimated time'}"
                      f" ({what})")
        ax.grid(axis="x", alpha=0.3)
        for y, r in zip(ys, rows):
            if r[6]:
                ax.axhspan(y - 0.5, y + 0.5, color="0.9", zorder=0)
    left.plot([r[5] / scale for r in rows], [y - h / 2 for y in ys], "k|", markersize=9,
              label="sent by this rank (measured, op by op)")
    handles, names = left.get_legend_handles_labels()
    if any(r[6] for r in rows):
        handles.append(plt.Rectangle((0, 0), 1, 1, color="0.9"))
        names.append("backward (shaded)")
    if not rows:
        left.text(0.5, 0.5, "no call of this step sends bytes", ha="center", transform=left.transAxes)
    if rows and rows[-1][0].startswith("others"):
        for ax in (left, right):
            ax.axhline(len(rows) - 1.5, color="black", linewidth=0.8)
    left.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
    left.set_ylim(max(len(rows), 1) - 0.5, -0.5)   # first call at the top
    left.legend(handles, names, fontsize=8, loc="best")
    fig.suptitle(_step_title(report, scale, unit), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --- the blocks ---------------------------------------------------------------------------

def _drawn_dims(layout: Layout) -> tuple:
    """The dims drawn: all of a 0-, 1- or 2-d tensor; else the split dims first (where
    the ranks differ), then the first dims, two in all, in dim order."""
    ndim = len(layout.shape)
    if ndim <= 2:
        return tuple(range(ndim))
    split = sorted({d for d in map(split_dim, layout.sbp) if d is not None})
    return tuple(sorted((split + [d for d in range(ndim) if d not in split])[:2]))


def _intervals(layout: Layout, rank: int) -> list:
    """Per dim, the (start, stop) ranges ``rank`` holds: one, or one per block of a
    strided split (its part is no box); none where it holds nothing of the dim."""
    plain = tuple(broadcast if isinstance(s, StridedSplit) else s for s in layout.sbp)
    region = Layout.make(layout.shape, layout.placement, plain).region(rank)
    out = [[(o, o + s)] if s else [] for o, s in zip(region.offsets, region.sizes)]
    coord = layout.placement.coord(rank)
    for axis, s in enumerate(layout.sbp):
        if isinstance(s, StridedSplit):
            block = layout.shape[s.dim] // s.blocks
            offset, size = balanced_split(block, layout.placement.shape[axis])[coord[axis]]
            out[s.dim] = [(b * block + offset, b * block + offset + size)
                          for b in range(s.blocks) if size]
    return out


def _cuts(length: int, parts: list) -> tuple:
    return tuple(sorted({0, length, *(e for iv in parts for a, b in iv for e in (a, b))}))


def _covers(intervals: list, lo: int, hi: int) -> bool:
    return any(a <= lo and hi <= b for a, b in intervals)


def _label(layout: Layout, ranks: tuple) -> str:
    """The ranks of one block: those differing only on partial axes hold addends
    ("0+1"), the groups of them copies ("0+1,2+3"); runs of more than four ranks are
    shortened ("0-31", "0+...+31")."""
    groups: dict = {}
    for r in ranks:
        key = tuple(c for a, c in enumerate(layout.placement.coord(r)) if a not in layout.partial_axes)
        groups.setdefault(key, []).append(r)
    if all(len(g) == 1 for g in groups.values()):
        return _runs([g[0] for g in groups.values()], ",", "{}-{}")
    return ",".join(_runs(g, "+", "{}+...+{}") for g in groups.values()) or "-"


def _runs(ranks: list, sep: str, run: str) -> str:
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 4:
            out.append(run.format(ranks[i], ranks[j]))
        else:
            out += map(str, ranks[i:j + 1])
        i = j + 1
    return sep.join(out) or "-"


def _notes(layout: Layout, dims: tuple, labels: list, empty: list) -> tuple:
    notes = []
    hidden = [d for d in range(len(layout.shape)) if d not in dims]
    if hidden:
        split = [d for d in hidden if d in set(map(split_dim, layout.sbp))]
        notes.append(f"{_dims(hidden)} not drawn" + (
            f" ({_dims(split)} split too: ranks sharing a block hold different parts of it)"
            if split else " (each block spans it whole)"))
    text = "".join(s for row in labels for s in row)
    if any(isinstance(s, Broadcast) for s in layout.sbp) and ("," in text or "-" in text):
        notes.append("a,b: copies of one block (broadcast)" + ("; a-b: ranks a to b" * ("-" in text)))
    for axis in layout.partial_axes:
        s = layout.sbp[axis]
        notes.append(f"a+b: addends of the block, their {s.reduce} is its value ({s}"
                     f"{f' on placement axis {axis}' if layout.placement.ndim > 1 else ''})")
    for s in layout.sbp:
        if isinstance(s, StridedSplit):
            notes.append(f"{s}: dim {s.dim} is {s.blocks} blocks of {layout.shape[s.dim] // s.blocks}, "
                         f"each split over the ranks: parts interleave")
    if empty:
        notes.append(f"rank(s) {', '.join(map(str, empty))} hold no elements")
    return tuple(notes)


def _dims(dims: list) -> str:
    return f"dim{'s' if len(dims) > 1 else ''} {', '.join(map(str, dims))}"


# --- the text picture ---------------------------------------------------------------------

def _caption(layout: Layout, dims: tuple) -> str:
    shape = layout.shape
    if len(dims) == 2:
        return f"rows: dim {dims[0]} ({shape[dims[0]]}), columns: dim {dims[1]} ({shape[dims[1]]})"
    return f"dim {dims[0]} ({shape[dims[0]]}) across" if dims else "a scalar"


def _cell_sizes(blocks: Blocks) -> tuple:
    """Characters across per column and lines down per row of blocks (borders apart):
    proportional to the blocks' lengths in a box of the tensor's shape, each at least
    one character and, where the box allows, as wide as its widest label."""
    nr, nc = len(blocks.row_cuts) - 1, len(blocks.col_cuts) - 1
    need = [max(len(blocks.labels[i][j]) for i in range(nr)) for j in range(nc)]
    if sum(need) + nc + 1 > MAX_WIDTH:
        need = [1] * nc
    rows, cols = blocks.row_cuts[-1], blocks.col_cuts[-1]
    if len(blocks.dims) < 2:   # one line of blocks across (a scalar: one small block)
        width, height = MAX_WIDTH if blocks.dims else need[0] + 6, 3
    else:   # a character is about twice as tall as wide
        width, height = MAX_WIDTH, round(MAX_WIDTH * rows / (2 * cols))
        if height > MAX_HEIGHT:
            width, height = max(round(2 * MAX_HEIGHT * cols / rows), 1), MAX_HEIGHT
    width = max(width, sum(need) + nc + 1, 16)   # a tall tensor: still room for labels
    height = max(height, 2 * nr + 1)
    return (_shares(_lengths(blocks.col_cuts), width - nc - 1, need),
            _shares(_lengths(blocks.row_cuts), height - nr - 1, [1] * nr))


def _lengths(cuts: tuple) -> list:
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _shares(lengths: list, total: int, minimum: list) -> list:
    """``total`` split in proportion to ``lengths``, each share at least its
    ``minimum`` (those below it get it, the others share the rest), rounded so that
    the shares add up to ``total``."""
    fixed: set = set()
    while True:
        budget = total - sum(minimum[i] for i in fixed)
        free = sum(n for i, n in enumerate(lengths) if i not in fixed) or 1
        ideal = [minimum[i] if i in fixed else n * budget / free for i, n in enumerate(lengths)]
        low = {i for i, v in enumerate(ideal) if i not in fixed and v < minimum[i]}
        if not low:
            break
        fixed |= low
    shares = [math.floor(v) for v in ideal]
    order = sorted(range(len(ideal)), key=lambda i: shares[i] - ideal[i])
    for i in order[:max(total - sum(shares), 0)]:
        shares[i] += 1
    return shares


def _canvas(blocks: Blocks, widths: list, heights: list) -> list:
    xs, ys = _edges(widths), _edges(heights)
    grid = [[" "] * (xs[-1] + 1) for _ in range(ys[-1] + 1)]
    for y in ys:
        grid[y] = ["+" if x in xs else "-" for x in range(xs[-1] + 1)]
    for i, (top, bottom) in enumerate(zip(ys, ys[1:])):
        for y in range(top + 1, bottom):
            for x in xs:
                grid[y][x] = "|"
        for j, (left, right) in enumerate(zip(xs, xs[1:])):
            text = _fit(blocks.labels[i][j], right - left - 1, bottom - top - 1)
            first = top + 1 + (bottom - top - 1 - len(text)) // 2
            for k, line in enumerate(text):
                start = left + 1 + (right - left - 1 - len(line)) // 2
                grid[first + k][start:start + len(line)] = list(line)
    return ["".join(row).rstrip() for row in grid]


def _edges(sizes: list) -> list:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s + 1)
    return out


def _fit(label: str, width: int, height: int) -> list:
    """``label`` in ``width`` x ``height`` characters: wrapped after its commas, or cut
    short with "~" where it does not fit."""
    pieces = [p + "," for p in label.split(",")[:-1]] + [label.split(",")[-1]]
    lines = [""]
    for p in pieces:
        if lines[-1] and len(lines[-1]) + len(p) > width:
            lines.append("")
        lines[-1] += p
    if len(lines) <= height and all(len(line) <= width for line in lines):
        return lines
    return [label if len(label) <= width else label[:width - 1] + "~" if width > 1 else "~"]


# --- the PNGs -----------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the pictures need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")    # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def _header(x, layout: Layout) -> str:
    dtype = "" if isinstance(x, Layout) else f" {x.dtype}"
    return f"{tuple(layout.shape)}{dtype} on {layout.placement}, sbp {layout.sbp}"


def _layout_axes(ax, layout: Layout, blocks: Blocks, rows: int, cols: int) -> None:
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)   # row 0 at the top, as the tensor prints
    dims = blocks.dims
    if dims:
        ax.set_xlabel(f"dim {dims[-1]} ({layout.shape[dims[-1]]})")
        if len(blocks.col_cuts) <= 17:
            ax.set_xticks(blocks.col_cuts)
    if len(dims) == 2:
        ax.set_ylabel(f"dim {dims[0]} ({layout.shape[dims[0]]})")
    if len(dims) == 2 and len(blocks.row_cuts) <= 17:
        ax.set_yticks(blocks.row_cuts)
    else:
        ax.set_yticks([])
    if not dims:
        ax.set_xticks([])


def _step_rows(report: "StepReport", top: int) -> list:
    """Per call that sends bytes (estimated or measured), in call order: (label, bytes
    op by op, bytes planned, seconds op by op, seconds planned, bytes sent, in
    backward); the ``top`` of them by bytes, the rest summed into one "others" row."""
    sending = [c for c in report.calls if max(c.per_op_bytes, c.planned_bytes, c.sent_bytes) > 0]
    keep = sorted(sorted(sending, key=lambda c: -max(c.per_op_bytes, c.planned_bytes))[:top],
                  key=lambda c: c.index)
    rows = [(f"#{c.index} {c.op}{' *' if c.per_op != c.planned else ''}", c.per_op_bytes,
             c.planned_bytes, c.per_op_cost, c.planned_cost, c.sent_bytes, c.in_backward)
            for c in keep]
    rest = [c for c in sending if c not in keep]
    if rest:
        rows.append((f"others ({len(rest)} calls)", *(sum(getattr(c, f) for c in rest) for f in (
            "per_op_bytes", "planned_bytes", "per_op_cost", "planned_cost", "sent_bytes")), False))
    return rows


def _byte_unit(largest: float) -> tuple:
    for scale, unit in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if largest >= scale:
            return scale, unit
    return 1, "B"


def _step_title(report: "StepReport", scale: int, unit: str) -> str:
    sending = sum(1 for c in report.calls if max(c.per_op_bytes, c.planned_bytes, c.sent_bytes) > 0)
    return (f"step of {len(report.calls)} calls ({sending} send bytes; * planned differently): "
            f"{report.per_op_bytes / scale:.1f} {unit} op by op, "
            f"{report.planned_bytes / scale:.1f} {unit} planned\n"
            f"estimated {report.per_op_cost * 1e3:.3f} ms op by op, "
            f"{report.planned_cost * 1e3:.3f} ms planned (boxing and compute)")
