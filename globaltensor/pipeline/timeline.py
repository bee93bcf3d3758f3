"""When each action of a pipeline step ran on each rank, and a picture of it.

Times are wall-clock seconds (``time.time()``), comparable between the processes of
one machine. The picture has one row per rank: forward blocks light, backward blocks
dark (one hue per stage), time spent waiting for a message hatched; white is bubble.

>>> pipe.step(x, y); pipe.timeline("schedule.png")   # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import comm
from . import schedule as S

_KINDS = (S.FORWARD, S.BACKWARD, "wait")


@dataclass
class Timeline:
    """Events of one step on this rank: (rank, kind, stage, mb, start, end)."""

    events: list = field(default_factory=list)

    def record(self, rank: int, action: S.Action, start: float, end: float) -> None:
        if action.kind in (S.FORWARD, S.BACKWARD):
            self.events.append((rank, action.kind, action.stage, action.mb, start, end))

    def record_wait(self, rank: int, key, start: float, end: float) -> None:
        if end - start > 1e-4:  # waits too short to see are left out
            self.events.append((rank, "wait", key[1], key[2], start, end))

    def gather(self) -> list:
        """Every rank's events, in rank order (a collective over the world). They
        travel as integers (microseconds), so nothing from a peer is unpickled."""
        flat = [v for rank, kind, stage, mb, t0, t1 in self.events
                for v in (rank, _KINDS.index(kind), stage, mb, round(t0 * 1e6), round(t1 * 1e6))]
        return [[(r[j], _KINDS[r[j + 1]], r[j + 2], r[j + 3], r[j + 4] / 1e6, r[j + 5] / 1e6)
                 for j in range(0, len(r), 6)] for r in comm.all_gather_ints(flat)]

    @staticmethod
    def busy_fraction(events_per_rank) -> float:
        """Compute time over (ranks x span of the step): 1 - the bubble fraction."""
        events = [e for evs in events_per_rank for e in evs]
        compute = [e for e in events if e[1] in (S.FORWARD, S.BACKWARD)]
        if not compute:
            return 0.0
        t0 = min(e[4] for e in events)
        t1 = max(e[5] for e in events)
        ranks = len([evs for evs in events_per_rank if evs])
        return sum(e[5] - e[4] for e in compute) / ((t1 - t0) * ranks)

    @staticmethod
    def plot(events_per_rank, path: str, title: str) -> None:
        """Write a PNG of every rank's events (needs matplotlib, the ``bench`` extra)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed (pip install matplotlib); no timeline written")
            return
        events = [e for evs in events_per_rank for e in evs]
        if not events:
            return
        t0 = min(e[4] for e in events)
        ranks = sorted({e[0] for e in events})
        cmap = matplotlib.colormaps["tab10"]
        fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.2))
        for rank, kind, stage, mb, start, end in events:
            y = ranks.index(rank)
            left, width = (start - t0) * 1e3, (end - start) * 1e3
            if kind == "wait":
                ax.barh(y, width, left=left, height=0.3, color="none", edgecolor="grey",
                        hatch="///", linewidth=0)
                continue
            color = cmap(stage % 10)
            alpha = 0.45 if kind == S.FORWARD else 1.0
            ax.barh(y, width, left=left, height=0.8, color=color, alpha=alpha,
                    edgecolor="black", linewidth=0.5)
            if width > 0:
                ax.text(left + width / 2, y, f"{kind}{mb}", ha="center", va="center",
                        fontsize=7)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        busy = Timeline.busy_fraction(events_per_rank)
        ax.set_title(f"{title} (light: forward, dark: backward, one hue per stage; "
                     f"bubble {1 - busy:.0%})", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
