"""Peak resident memory of this process around a block (Linux): the kernel's high-water
mark (VmHWM) is reset by writing 5 to /proc/self/clear_refs, so the rise is measured,
not inferred from sizes. Free heap memory is returned to the OS before each block."""
from __future__ import annotations

import contextlib


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class Peak:
    mib: float = 0.0


@contextlib.contextmanager
def peak_rise():
    """``with peak_rise() as p: ...`` then ``p.mib``: peak RSS during the block minus the
    RSS at its start, in MiB."""
    import ctypes
    import gc
    gc.collect()
    # free heap pages go back to the OS first: in a process that ran other checks, a
    # block could otherwise reuse resident pages and show a rise smaller than it is
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    peak = Peak()
    start = _status_mib("VmRSS")
    yield peak
    peak.mib = _status_mib("VmHWM") - start
