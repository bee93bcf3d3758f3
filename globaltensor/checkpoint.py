"""``gt.checkpoint``: resuming in one line (``Autosave``), what to save besides the model
for resuming by hand (the random state), which checkpoint directories are complete, and
DTensor conversion.

Checkpoints themselves go through torch.distributed.checkpoint (DCP), which GlobalTensor
answers as a tensor subclass (``interop/dcp.py``): every element is written once, and
a checkpoint loads into any layout, placement or world size.

>>> import torch.distributed.checkpoint as dcp                     # doctest: +SKIP
>>> state = {"model": model.state_dict(), "rng": gt.checkpoint.rng_state()}
>>> dcp.save(state, checkpoint_id="ckpt/step_100")
>>> dcp.load(state, checkpoint_id=gt.checkpoint.latest("ckpt"))
>>> gt.checkpoint.set_rng_state(state["rng"])

Verified checkpoints: ``ChecksummedWriter(path)`` (DCP's FileSystemWriter that records
a CRC-32 per chunk) and ``VerifyingReader(path)`` (checks each chunk it reads; a damaged
file fails the load, naming the file and tensor; so does a damaged ``.metadata``, whose
own CRC-32 lies beside it in ``.metadata.crc32``), passed to DCP as its storage
(``interop/checksums.py``). ``Autosave`` uses them. Loading GlobalTensors from a
checkpoint that carries checksums with DCP's own reader (``checkpoint_id=path``)
works but is unverified: it warns once per checkpoint (``UnverifiedLoadWarning``).

>>> dcp.save(state, storage_writer=gt.checkpoint.ChecksummedWriter("ckpt/step_100"))  # doctest: +SKIP
>>> dcp.load(state, storage_reader=gt.checkpoint.VerifyingReader("ckpt/step_100"))
"""
from __future__ import annotations

import io
import os
import re
import shutil

import torch

from . import comm
from .interop.dcp import DCP_HINT
from .interop.dtensor import from_dtensor, to_dtensor
from .planner import record as steps
from .random import get_draw, set_draw

__all__ = ["Autosave", "from_dtensor", "to_dtensor", "rng_state",
           "set_rng_state", "is_complete", "latest", "DCP_HINT", "ChecksummedWriter",
           "VerifyingReader", "ChecksumError", "UnverifiedLoadWarning"]

_CHECKSUMS = ("ChecksummedWriter", "VerifyingReader", "ChecksumError", "UnverifiedLoadWarning")


def __getattr__(name: str):
    # interop/checksums.py imports DCP's filesystem storage: only when first asked for
    if name in _CHECKSUMS:
        from .interop import checksums
        return getattr(checksums, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def rng_state() -> dict:
    """The random state to save with a checkpoint: gt's generator (seed and draw count,
    the same on every rank) and torch's own CPU generator, as plain tensors (DCP saves
    them once and loads them in place).

    >>> state = {"model": model.state_dict(), "rng": gt.checkpoint.rng_state()}  # doctest: +SKIP
    """
    return {"gt": torch.tensor(get_draw(), dtype=torch.int64),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (after ``dcp.load`` filled it in)."""
    torch.set_rng_state(state["torch"])
    # After torch's: torch.set_rng_state may also restore a draw number it carries on
    # the state tensor's Python object, which in a template filled by dcp.load is stale.
    set_draw(tuple(int(v) for v in state["gt"].tolist()))


def is_complete(path: str | os.PathLike) -> bool:
    """True when the DCP checkpoint directory ``path`` was fully written: DCP writes
    its ``.metadata`` last (to a temporary name, then renames it), after every rank's
    data, so a directory without it is a save that crashed."""
    return os.path.isfile(os.path.join(os.fspath(path), ".metadata"))


def latest(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directory under ``root`` (by name order of
    ``step_<n>``-style names, compared numerically), or None.

    >>> gt.checkpoint.latest("ckpt")                                    # doctest: +SKIP
    'ckpt/step_40'
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None

    def key(name: str):
        digits = "".join(ch for ch in name if ch.isdigit())
        return (int(digits) if digits else -1, name)

    done = [n for n in os.listdir(root) if is_complete(os.path.join(root, n))]
    return os.path.join(root, max(done, key=key)) if done else None


# --- resuming in one line ---------------------------------------------------------------

_STEP_DIR = re.compile(r"step_(\d+)")


def _step_dirs(root: str) -> dict[int, str]:
    """``step_<n>`` directories under ``root`` by step (complete or not)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return {int(m.group(1)): os.path.join(root, n)
            for n in names if (m := _STEP_DIR.fullmatch(n))}


def _remove(path: str) -> None:
    # .metadata first: a removal cut short leaves an incomplete checkpoint (skipped),
    # never a complete-looking one with files missing.
    metadata = os.path.join(path, ".metadata")
    if os.path.exists(metadata):
        os.remove(metadata)
    shutil.rmtree(path, ignore_errors=True)


def _ranks(verdicts: list, verdict: int) -> str:
    return f"rank(s) {[r for r, v in enumerate(verdicts) if v == verdict]}"


def _is_stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


class Autosave:
    """Saves ``model``, ``optimizer``, the random state, ``self.state`` (a dict the user
    fills, e.g. the data position) and the step every ``every`` steps into
    ``path/step_<n>`` with torch.distributed.checkpoint, keeping the newest ``keep``
    complete checkpoints; ``restore`` loads the newest complete one into the current
    model's layout (any world size or placement).

    A save is atomic: DCP writes ``.metadata`` last, after every rank's data, and a
    directory without it is never restored (``latest`` skips it). Values in ``state``
    are small picklable objects, saved once; one with ``state_dict``/``load_state_dict``
    (an LR scheduler, a data loader) is saved and restored through those. Every chunk
    saved carries a CRC-32 (``ChecksummedWriter``), checked by ``restore``
    (``VerifyingReader``): a damaged newest checkpoint is skipped with a warning on every
    rank, and the newest intact one is restored. Saves are synchronous: DCP's
    ``async_save`` shares the process group with training's collectives and does not
    know how to stage GlobalTensors. A resumed run ends with the bits of the
    uninterrupted one (same world and layouts): each save and restore starts the
    whole-step planner over (``planner.record.restart``: the next step is recorded
    and planned), so both runs replay the same plans from the same step.

    >>> saver = gt.checkpoint.Autosave("ckpt", model, optimizer, every=100, keep=2)  # doctest: +SKIP
    >>> saver.state["sched"] = scheduler
    >>> for step in range(saver.restore(), steps):
    ...     train_one_step(); optimizer.step()
    ...     saver.step(step + 1)
    """

    def __init__(self, path: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, every: int = 100,
                 keep: int = 2):
        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Autosave: {name} must be an int >= 1, got {value!r}")
        path = os.fspath(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotADirectoryError(f"Autosave: path {path!r} exists and is not a "
                                     f"directory (checkpoints go to {path}/step_<n>)")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Autosave: model must be a torch.nn.Module, got "
                            f"{type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Autosave: optimizer must be a torch.optim.Optimizer or None, "
                            f"got {type(optimizer).__name__}")
        self.path, self.model, self.optimizer = path, model, optimizer
        self.every, self.keep = every, keep
        self.state: dict = {}

    def restore(self) -> int:
        """Load the newest complete checkpoint under ``path`` (model, optimizer, random
        state, ``self.state``) and return its step; 0 if there is none. Every rank must
        see the same one (a shared filesystem): otherwise it raises on every rank.

        A checkpoint found damaged (``ChecksumError``: a chunk or its ``.metadata`` does
        not hold what was saved, on any rank) is skipped with a warning on every rank
        naming it and why, and the next older complete one is loaded (``keep`` >= 2
        keeps one); the damaged directory is left as it is (the next save of its step
        replaces it). The ranks agree (a collective) on each checkpoint's verdict before
        choosing, so they all load the same one. When every one is damaged it raises
        on every rank, naming them; other errors (a model that does not match the
        checkpoint) raise as before."""
        done = [step for step, d in _step_dirs(self.path).items() if is_complete(d)]
        step = max(done, default=0)
        seen = sorted({s for s, in comm.all_gather_ints([step])})
        if len(seen) > 1:
            raise RuntimeError(f"Autosave.restore: ranks see different newest checkpoints "
                               f"under {self.path!r} (steps {seen}); the path must be on a "
                               f"filesystem every rank shares")
        if step == 0:
            return 0
        skipped: list = []   # (directory, why)
        for candidate in sorted(done, reverse=True):
            directory = _step_dirs(self.path)[candidate]
            # its .metadata, then the load: after each, every rank's verdict (0 fine,
            # 1 damaged, 2 failed otherwise), so that all choose alike and none is left
            # in a collective the others skipped
            for attempt in (self._check_metadata, self._load):
                verdict, why, error = attempt(directory)
                verdicts = [v for v, in comm.all_gather_ints([verdict], same_length=True)]
                if max(verdicts) > 0:
                    break
            if max(verdicts) == 0:
                if skipped:
                    import warnings
                    warnings.warn(
                        "Autosave.restore: skipped damaged checkpoint(s) "
                        + "; ".join(f"{d} ({why})" for d, why in skipped)
                        + f"; restored {directory} (step {candidate}) instead",
                        RuntimeWarning, stacklevel=2)
                steps.restart()   # plan as the run that saved it did after the save
                return self._restored
            if max(verdicts) == 2:
                if verdict == 2:
                    raise error
                raise RuntimeError(f"Autosave.restore: loading {directory} failed on "
                                   f"{_ranks(verdicts, 2)}, not for a damaged file: see "
                                   f"that rank's error")
            skipped.append((directory, why or f"damaged on {_ranks(verdicts, 1)}"))
        from .interop.checksums import ChecksumError
        raise ChecksumError("Autosave.restore: every complete checkpoint under "
                            f"{self.path!r} is damaged: "
                            + "; ".join(f"{d} ({why})" for d, why in skipped))

    @staticmethod
    def _check_metadata(directory: str) -> tuple:
        """(0, "", None) when ``directory``'s .metadata reads and matches its checksum,
        (1, why, error) when it is damaged, (2, why, error) on another error."""
        from .interop.checksums import ChecksumError, VerifyingReader
        try:
            VerifyingReader(directory).read_metadata()
            return 0, "", None
        except ChecksumError as e:
            return 1, str(e), e
        except Exception as e:  # noqa: BLE001 - the verdict is shared first, then raised
            return 2, str(e), e

    def _load(self, directory: str) -> tuple:
        """Load ``directory`` into the model, optimizer and state (``self._restored``:
        its step); the verdict as ``_check_metadata``'s."""
        import torch.distributed.checkpoint as dcp

        from .interop.checksums import ChecksumError, VerifyingReader
        try:
            contents = self._contents(0)
            dcp.load(contents, storage_reader=VerifyingReader(directory))
            self._put_back(contents)
            self._restored = int(contents["step"])
            return 0, "", None
        except ChecksumError as e:
            return 1, str(e), e
        except dcp.CheckpointException as e:
            # DCP gathers every rank's failures: each rank names the damage any saw
            damage = [(rank, pair[0]) for rank, pair in sorted(e.failures.items())
                      if isinstance(pair[0], ChecksumError)]
            if damage:
                return 1, "; ".join(f"rank {rank}: {err}" for rank, err in damage), e
            return 2, str(e), e
        except Exception as e:  # noqa: BLE001 - the verdict is shared first, then raised
            return 2, str(e), e

    def step(self, step: int) -> bool:
        """Called after each training step with the number of steps done: saves when
        ``step`` is a multiple of ``every`` (then removes all but the newest ``keep``
        checkpoints); returns whether it saved."""
        if step % self.every:
            return False
        import torch.distributed.checkpoint as dcp

        from .interop.checksums import ChecksummedWriter
        target = os.path.join(self.path, f"step_{step}")
        if comm.get_rank() == 0 and os.path.exists(target):
            # left by a save that died (or a run that went past here before): replaced
            _remove(target)
        # every rank waits for that: dcp.save's local plan makes the directory on every
        # rank, and a rank there first would otherwise see rank 0 remove it
        comm.barrier()
        dcp.save(self._contents(step), storage_writer=ChecksummedWriter(target))
        steps.restart()   # plan the next steps as a run resumed from here will
        if comm.get_rank() == 0:
            self._remove_old()
        return True

    def _contents(self, step: int) -> dict:
        """What a checkpoint holds, in the current layouts (dcp.load fills it in)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
        if self.optimizer is None:
            model_sd, optim_sd = get_model_state_dict(self.model), {}
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        user = {k: v.state_dict() if _is_stateful(v) else v for k, v in self.state.items()}
        buffer = io.BytesIO()   # one object, saved once: restored whatever keys are set
        torch.save(user, buffer)
        return {"step": step, "model": model_sd, "optim": optim_sd, "rng": rng_state(),
                "state": buffer}

    def _put_back(self, contents: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
        if self.optimizer is None:
            set_model_state_dict(self.model, contents["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=contents["model"],
                           optim_state_dict=contents["optim"])
        set_rng_state(contents["rng"])
        buffer = contents["state"]   # the saved BytesIO, in place of the template's
        buffer.seek(0)
        for key, value in torch.load(buffer, weights_only=False).items():
            if _is_stateful(self.state.get(key)):
                self.state[key].load_state_dict(value)
            else:
                self.state[key] = value

    def _remove_old(self) -> None:
        dirs = _step_dirs(self.path)
        kept = sorted((s for s, d in dirs.items() if is_complete(d)), reverse=True)[:self.keep]
        for step, d in dirs.items():
            if step < min(kept):
                _remove(d)
