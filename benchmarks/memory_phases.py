"""Resident memory per phase of a training step (benchmarks/memory.py uses it).

A ``PhaseRecorder`` is told where a step is (``mark(label)``: each Linear's forward and
backward, each gradient-reduction collective, the optimizer step). At every mark the
kernel's high-water mark since the previous mark (VmHWM, then reset through
/proc/self/clear_refs) is the finished phase's peak, so no allocation between two
marks is missed however short it lived. A background thread samples the resident size
(/proc/self/statm) every ``interval`` seconds for the timeline picture.

>>> rec = PhaseRecorder(base_mib=data_mib())                        # doctest: +SKIP
>>> instrument(model, opt, rec); rec.start(); step(); rec.stop()   # doctest: +SKIP
>>> rec.peaks   # {"forward 0": 312.5, "backward 0": 590.1, ...} MiB above base
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

# the collectives that reduce gradients (FSDP2: reduce_scatter_single; ours: the same or
# all_to_all_single; DDP reduces from C++ and shows no reduce phase of its own)
REDUCING = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single", "all_reduce")


def status_mib(*keys: str) -> float:
    """The sum of /proc/self/status entries ``keys`` (e.g. "VmHWM"), in MiB."""
    total, found = 0.0, 0
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                total += int(rest.split()[0]) / 1024
                found += 1
    if found != len(keys):
        raise RuntimeError(f"not all of {keys} in /proc/self/status")
    return total


def data_mib() -> float:
    """Resident memory that is data, not code: RssAnon + RssShmem (VmRSS less the pages of
    mapped files, i.e. the shared libraries' code, which a first call of a kernel reads
    in and which stays resident)."""
    return status_mib("RssAnon", "RssShmem")


def data_hwm_mib() -> float:
    """The high-water mark less the pages of mapped files resident now (code pages only
    grow, so this is the data's high-water mark while none were read in since the
    reset)."""
    return status_mib("VmHWM") - status_mib("RssFile")


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PhaseRecorder:
    """Peak resident data (MiB above ``base_mib``, a ``data_mib()``) per phase label, and
    a sampled timeline of (seconds, MiB, label)."""

    def __init__(self, base_mib: float, interval: float = 0.002):
        self.base, self.interval = base_mib, interval
        self.peaks: dict = {}          # label -> peak MiB above base (max over visits)
        self.label: str | None = None
        self.samples: list = []        # (t, MiB above base, label)
        self.marks: list = []          # (t, label)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.perf_counter()

    def mark(self, label: str) -> None:
        """The phase ``label`` starts; the previous one ends here."""
        if self.label is not None:
            peak = data_hwm_mib() - self.base
            self.peaks[self.label] = max(self.peaks.get(self.label, peak), peak)
        reset_hwm()
        self.label = label
        self.marks.append((time.perf_counter() - self.t0, label))

    def start(self, label: str = "start") -> None:
        self.t0 = time.perf_counter()
        self.samples, self.marks = [], []
        self.mark(label)
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.mark("end")
        self._stop.set()
        self._thread.join()
        self.label = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, data_mib() - self.base,
                                 self.label))
            time.sleep(self.interval)


def instrument(modules: list, opt: torch.optim.Optimizer, rec: PhaseRecorder):
    """Marks at each of ``modules``' forward (before any hook of its own: a gather counts
    in it) and backward ("L<k>": the k-th module), around each reducing collective, and
    at the optimizer step. Returns an undo function."""
    handles = []
    for k, m in enumerate(modules):
        handles.append(m.register_forward_pre_hook(
            lambda *a, k=k: rec.mark(f"forward L{k}"), prepend=True))
        handles.append(m.register_full_backward_pre_hook(
            lambda *a, k=k: rec.mark(f"backward L{k}"), prepend=True))
    handles.append(opt.register_step_pre_hook(lambda *a: rec.mark("optimizer step")))
    originals = {}
    for name in REDUCING:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def reducing(*args, _fn=fn, **kwargs):
            if rec.label is None or not rec.label.startswith(("backward", "reduce")):
                return _fn(*args, **kwargs)
            was = rec.label.removeprefix("reduce in ")
            rec.mark(f"reduce in {was}")
            try:
                return _fn(*args, **kwargs)
            finally:
                rec.mark(was)
        setattr(dist, name, reducing)

    def undo():
        for h in handles:
            h.remove()
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return undo


def phase_order(per_mode: dict) -> list:
    """Labels in the order a step runs them (forward by layer, backward from the last
    layer, each reduction after its backward, then the optimizer)."""
    def key(label):
        kind, _, rest = label.partition(" ")
        if kind == "start":
            return (0, 0, 0)
        if kind == "forward":
            return (1, int(rest[1:]), 0)
        if kind == "loss":
            return (2, 0, 0)
        if kind in ("backward", "reduce"):
            layer = int(label.rsplit("L", 1)[1])
            return (3, -layer, int(kind == "reduce"))
        return (4, ["optimizer step", "end"].index(label) if label in ("optimizer step", "end")
                else 9, 0)
    labels = {label for peaks in per_mode.values() for label in peaks}
    return sorted(labels, key=key)


def timeline_plot(path: str, per_mode: dict, persistent: dict, title: str) -> None:
    """One panel per mode: sampled resident memory over a step, phases shaded (forward
    blue, backward orange, reduction red, optimizer green), the ZeRO floor
    (parameters + gradients + 2 moments, per rank) dashed. ``per_mode``: mode ->
    (samples, marks)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); no timeline written")
        return
    colours = {"forward": "tab:blue", "backward": "tab:orange", "reduce": "tab:red",
               "optimizer": "tab:green"}
    modes = list(per_mode)
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 4), sharey=True,
                             squeeze=False)
    for ax, mode in zip(axes[0], modes):
        samples, marks = per_mode[mode]
        for (t, label), (t_next, _) in zip(marks, marks[1:]):
            colour = colours.get(label.split(" ")[0])
            if colour:
                ax.axvspan(t, t_next, color=colour, alpha=0.15, lw=0)
        ax.plot([s[0] for s in samples], [s[1] for s in samples], color="black", lw=1)
        for label, value in persistent.items():
            ax.axhline(value, ls="--", lw=1, color="grey")
            ax.text(0, value, label, fontsize=7, va="bottom", color="grey")
        ax.set_title(mode)
        ax.set_xlabel("seconds into the step")
    axes[0][0].set_ylabel("resident data above start (MiB)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in colours.values()]
    fig.legend(handles, list(colours), loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    print(f"timeline written to {path}")
