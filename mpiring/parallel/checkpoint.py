"""Checkpoints that survive a crash in the middle of a write, and a replica check.

A checkpoint is one file, ``DIR/ckpt-{step:09d}.pt``, written by ``torch.save``
and read back with ``torch.load(weights_only=True)`` (tensors and plain data
only: loading never runs code from the file). A write is atomic:

1. the state goes into a new temporary file in the same directory
   (``.ckpt-{step}.pt.tmp-{host}-{pid}-{random}``, created with ``O_EXCL`` and
   ``O_NOFOLLOW``, so nothing planted there is followed or overwritten);
2. the file is flushed and ``fsync``\\ ed;
3. ``os.replace`` renames it to its final name (atomic on POSIX; a symlink
   already at that name is replaced, never followed);
4. the directory is ``fsync``\\ ed so that the rename itself is on disk.

A crash at any point leaves the previous checkpoints as they were, plus at
worst a temporary file that ``latest_checkpoint`` ignores and the next save of
the same host removes.

Each file carries its own checksum: before the rename, one more archive member
(``CHECKSUM_MEMBER``) gets the SHA-256 of every other member's name and bytes.
``load_checkpoint`` recomputes it and raises ``CheckpointCorruptError`` naming
the file on any difference (a flipped byte, a truncation, a foreign edit);
files written before the checksum existed are checked with the archive's own
CRC-32s. ``latest_checkpoint`` returns the newest file that passes, warns
(``CheckpointWarning``) naming each newer damaged one, and raises when files
exist but none is usable: a resume must fail, not restart from step 0.

What a training checkpoint holds (``training_state``): the step, the model's
and the optimizer's ``state_dict``, the sampler's position and the RNG states
of Python, NumPy and torch (CUDA too when present). ``restore_training_state``
puts them all back, so a resumed run draws the same random numbers as an
uninterrupted one.

Typical use in a training loop (rank 0 writes; every rank reads)::

    path = latest_checkpoint(args.checkpoint_dir)
    step = restore_training_state(load_checkpoint(path), model, opt, sampler) if path else 0
    ...
    if comm.rank == 0 and step % every == 0:
        save_checkpoint(args.checkpoint_dir, training_state(step, model, opt, sampler))
    if step % check_every == 0:
        check_replicas(model, comm, step=step)
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import secrets
import socket
import warnings
import zipfile
from typing import Any

import numpy as np

FORMAT = "mpiring-checkpoint-1"
_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")
# The temporary names ``write_atomic`` gives (a checkpoint's, or a sharded save's files).
_TEMP = re.compile(r"^\.[^/]+\.pt\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]+$")


#: The archive member (in torch's top folder) that holds the file's SHA-256 of
#: every other member.
CHECKSUM_MEMBER = ".mpiring-sha256"


class ReplicaDivergenceError(RuntimeError):
    """The ranks' copies of the model differ (raised on every rank)."""


class CheckpointCorruptError(ValueError):
    """A checkpoint file is damaged (checksum, truncation, unreadable archive)."""


class CheckpointWarning(UserWarning):
    """A newer checkpoint was damaged and an older, good one is used instead."""


def checkpoint_name(step: int) -> str:
    """``ckpt-000000120.pt`` for step 120: names sort in step order."""
    return f"ckpt-{int(step):09d}.pt"


# --- RNG states -------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """The RNG states of Python, NumPy's global generator and torch (CPU and CUDA)."""
    import torch

    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        # NumPy's state as a tensor and plain numbers: weights_only loading takes
        # tensors, not NumPy arrays.
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
        "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- what a training checkpoint holds ----------------------------------------------------

def training_state(step: int, model=None, optimizer=None, sampler=None,
                   extra: dict[str, Any] | None = None, *, comm=None) -> dict[str, Any]:
    """Everything a resumed run needs, as a dict ``save_checkpoint`` can write.

    Without ``comm`` the random-number state is this rank's alone; with it, the call
    is collective (every rank of ``comm`` makes it) and the state holds every rank's
    too, so that ranks seeded apart (``seed + rank``) each resume their own stream.

    Args:
        step: the number of optimizer steps taken so far.
        model: a ``torch.nn.Module`` (its ``state_dict()``).
        optimizer: a ``torch.optim.Optimizer`` (its ``state_dict()``).
        sampler: anything with ``state_dict()`` (``mpiring.parallel.data.DistributedSampler``),
            or plain data (an int position, a dict) stored as it is.
        extra: more plain data (tensors, numbers, strings, lists, dicts).
        comm: gather every rank's random-number state (see above).
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step={step!r}: give the non-negative number of steps taken")
    state = {
        "format": FORMAT,
        "step": int(step),
        "model": model.state_dict() if model is not None else None,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "sampler": sampler.state_dict() if hasattr(sampler, "state_dict") else sampler,
        "rng": rng_state(),
        "extra": extra,
    }
    if comm is not None:
        from mpiring.comm.functional import all_gather_object

        ranks: list[Any] = [None] * comm.size
        all_gather_object(ranks, state["rng"], group=comm)
        state["rng_ranks"] = ranks
    return state


def restore_training_state(state: dict[str, Any], model=None, optimizer=None, sampler=None,
                           *, rng: bool = True, comm=None) -> int:
    """Load ``state`` (from ``load_checkpoint``) into the objects given; returns the step.

    With ``comm``, each rank takes its own random-number state where the checkpoint
    holds every rank's (``training_state(..., comm=comm)``); a rank the checkpoint
    has none for (it was saved on fewer ranks), or a checkpoint of one rank's state,
    takes that saved state, with a ``CheckpointWarning`` where ranks should differ.
    """
    if model is not None:
        model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if sampler is not None and hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(state["sampler"])
    if rng:
        ranks = state.get("rng_ranks")
        if comm is not None and ranks and comm.rank < len(ranks):
            set_rng_state(ranks[comm.rank])
        else:
            if comm is not None and comm.size > 1:
                # Each rank drawing the saved rank's numbers is what this checkpoint
                # can give; an uninterrupted run's ranks would have drawn their own.
                why = (f"it holds the states of {len(ranks)} rank(s)" if ranks else
                       "it holds one rank's state (save with training_state(..., comm=comm))")
                warnings.warn(f"restore_training_state: r{comm.rank} takes the saved random-"
                              f"number state, not its own: {why}", CheckpointWarning,
                              stacklevel=2)
            set_rng_state(state["rng"])
    return int(state["step"])


# --- files --------------------------------------------------------------------------------

def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temporaries(directory: str) -> None:
    # Only this host's, and only those whose writer is gone: another process may
    # be writing one right now (a shared directory, a second job).
    host = socket.gethostname()
    for entry in os.scandir(directory):
        m = _TEMP.match(entry.name)
        if not m or m["host"] != host or int(m["pid"]) == os.getpid():
            continue
        try:
            os.kill(int(m["pid"]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # someone else's live process
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass


def save_checkpoint(directory: str, state: dict[str, Any], *, keep: int | None = None) -> str:
    """Write ``state`` atomically as ``DIR/ckpt-{step}.pt``; returns the path.

    Args:
        directory: created if missing (mode 0o700 for new directories).
        state: a dict with an integer ``"step"`` (``training_state`` builds one).
        keep: if given, remove all but the newest ``keep`` complete checkpoints
            after this one is safely on disk.

    Raises:
        ValueError: ``state`` has no valid step, or ``keep`` < 1.
    """

    step = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError("state must be a dict with a non-negative integer 'step' "
                         "(build it with mpiring.parallel.checkpoint.training_state)")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint (or None for all)")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    _remove_stale_temporaries(directory)
    final = write_atomic(os.path.join(directory, checkpoint_name(step)), state)
    if keep is not None:
        # Count only checkpoints up to this step: a newer file belongs to a run that
        # was resumed from an earlier step (after ``latest_checkpoint`` skipped a
        # damaged newest one, say). Counting it would delete the file just written
        # and keep the damaged one, leaving nothing to resume from.
        older = [c for c in _checkpoints(directory) if c[0] <= step]
        for old in older[keep:]:
            os.unlink(os.path.join(directory, old[1]))
    return final


def write_atomic(path: str, obj: Any) -> str:
    """``torch.save(obj)`` to ``path`` so that ``path`` is either the old file or the whole
    new one: a new temporary file beside it, its checksum, a ``weights_only`` read-back,
    fsync, rename, fsync of the folder. Returns ``path``.

    Raises:
        ValueError: ``torch.load(weights_only=True)`` could not read ``obj`` back
            (nothing is written).
    """
    import torch

    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-"
                                   f"{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
        _add_checksum(temp)
        _check_loadable(temp, path)
        with open(temp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory or ".")
    return path


def _check_loadable(temp: str, final: str) -> None:
    """Refuse, before the rename, a state that ``load_checkpoint`` could not read back.

    ``torch.save`` pickles anything, but ``torch.load(weights_only=True)`` takes only
    tensors and plain data: a NumPy scalar in ``extra`` would be written without a
    word and found only at the resume, reported as damage. ``mmap=True`` unpickles
    the small ``data.pkl`` alone and maps the tensor bytes without reading them.
    """
    import torch

    try:
        torch.load(temp, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch's UnpicklingError names the type
        why = str(exc).strip().splitlines()
        detail = next((line for line in why if "GLOBAL" in line or "Unsupported" in line),
                      why[0] if why else type(exc).__name__).split(". Please use")[0]
        raise ValueError(
            f"{os.path.basename(final)} not written: load_checkpoint could not read this state "
            f"back (torch.load(weights_only=True) takes tensors and plain Python data only): "
            f"{detail.strip()}. Convert NumPy values and other objects first (float(x), "
            f"torch.from_numpy(a), a dict of plain values)") from None


def _checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, name) of the regular files named like checkpoints, newest first."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        m = _NAME.match(entry.name)
        if m and entry.is_file(follow_symlinks=False):  # never a planted symlink
            found.append((int(m.group(1)), entry.name))
    return sorted(found, reverse=True)


def _open_nofollow(path: str):
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


def _digest(archive: zipfile.ZipFile) -> str:
    h = hashlib.sha256()
    for info in archive.infolist():
        if info.filename.endswith("/" + CHECKSUM_MEMBER):
            continue
        h.update(info.filename.encode() + b"\0")
        with archive.open(info) as member:  # also checks the member's CRC-32
            for block in iter(lambda: member.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _add_checksum(path: str) -> None:
    with zipfile.ZipFile(path, "a") as archive:
        # torch.load wants every member inside the archive's top folder.
        top = archive.namelist()[0].split("/", 1)[0]
        archive.writestr(f"{top}/{CHECKSUM_MEMBER}", _digest(archive))


def verify_checkpoint(path: str) -> None:
    """Check the file's checksum (or, for an older file, its archive's CRC-32s).

    Raises:
        CheckpointCorruptError: naming the file and what is wrong with it.
        OSError: missing, or a symlink.
    """
    name = os.path.basename(path)
    try:
        with _open_nofollow(path) as fh, zipfile.ZipFile(fh) as archive:
            names = archive.namelist()
            if not any(n.endswith("/data.pkl") for n in names):
                raise CheckpointCorruptError(f"{name}: damaged (no data.pkl in the archive)")
            actual = _digest(archive)
            sums = [n for n in names if n.endswith("/" + CHECKSUM_MEMBER)]
            if sums:
                stored = archive.read(sums[0]).decode(errors="replace")
                if stored != actual:
                    raise CheckpointCorruptError(
                        f"{name}: damaged (checksum mismatch: stored sha256 {stored[:16]}..., "
                        f"the file's {actual[:16]}...)")
    except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile) as exc:
        raise CheckpointCorruptError(f"{name}: damaged (not a whole archive: {exc}; "
                                     "truncated or overwritten)") from None
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):
            raise
        raise CheckpointCorruptError(f"{name}: damaged (unreadable: {exc})") from None


def is_complete(path: str) -> bool:
    """Whether ``path`` is a whole checkpoint archive (its zip directory is readable)."""
    try:
        with _open_nofollow(path) as fh, zipfile.ZipFile(fh) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def scan_checkpoints(directory: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint that passes ``verify_checkpoint``, and the newer damaged
    ones as (path, reason); temporary files, symlinks and other names are ignored."""
    damaged = []
    for _, name in _checkpoints(directory):
        path = os.path.join(directory, name)
        try:
            verify_checkpoint(path)
        except (CheckpointCorruptError, OSError) as exc:
            damaged.append((path, str(exc)))
            continue
        return path, damaged
    return None, damaged


def latest_checkpoint(directory: str) -> str | None:
    """The newest good checkpoint in ``directory``, or None if it holds none at all.

    A newer damaged one is skipped with a ``CheckpointWarning`` naming it.

    Raises:
        CheckpointCorruptError: checkpoints exist but every one is damaged (a
            resume must not silently start again from step 0).
    """
    path, damaged = scan_checkpoints(directory)
    if path is None and damaged:
        raise CheckpointCorruptError(
            f"no usable checkpoint in {directory}: " + "; ".join(r for _, r in damaged)
            + ". Restore a copy, or start a new run in an empty directory (remove these "
            "files to start from step 0 on purpose)")
    for _, reason in damaged:
        warnings.warn(f"{reason}; using the previous good checkpoint, "
                      f"{os.path.basename(path)}", CheckpointWarning, stacklevel=2)
    return path


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)``, on the CPU.

    The file's checksum is verified first (``verify_checkpoint``).

    Raises:
        CheckpointCorruptError: the file is damaged (names it and what is wrong).
        ValueError: not an mpiring checkpoint.
        OSError: missing, or a symlink (``ELOOP``: checkpoints are never read
            through a link).
    """
    import torch

    try:
        verify_checkpoint(path)
        with _open_nofollow(path) as fh:
            state = torch.load(fh, map_location="cpu", weights_only=True)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(exc.errno, f"{path} is a symlink: checkpoints are never read "
                                     "through a link; pass the real file") from exc
        raise
    except CheckpointCorruptError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever torch raises on bad bytes
        raise CheckpointCorruptError(f"{os.path.basename(path)}: damaged (cannot be read "
                                     f"back: {type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not an mpiring checkpoint (no format {FORMAT!r})")
    return state


# --- replicas ------------------------------------------------------------------------------

def _tensor_digests(module, buffers: bool) -> tuple[list[str], list[int]]:
    import torch

    names, digests = [], []
    tensors = list(module.named_parameters()) + (list(module.named_buffers()) if buffers else [])
    for name, t in tensors:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        names.append(name)
        digests.append(int.from_bytes(h.digest(), "little", signed=True))
    return names, digests


def _allgather(comm, values: list[int]) -> np.ndarray:
    vec = np.array(values, dtype=np.int64)
    be = getattr(comm, "_be", None)
    if be is not None and hasattr(be, "exchange"):  # under the watchdog's deadline
        return be.exchange(vec)
    from mpiring.backends.control import allgather_array

    return allgather_array(comm, vec)


def check_replicas(module, comm, *, step: int | None = None, buffers: bool = False) -> None:
    """Hash every parameter on every rank; raise on every rank if they differ.

    One small Allgather when the replicas agree (a count and one hash per rank);
    on a difference a second one finds which tensors differ.

    Buffers are left out unless ``buffers=True``: DDP broadcasts them at the start
    of a forward and each rank's forward then updates its own (BatchNorm's running
    statistics), so healthy replicas hold different ones after every step.

    Raises:
        ReplicaDivergenceError: naming the ranks that differ from the majority
            (ties: from rank 0's group) and their first differing tensors.
    """
    names, digests = _tensor_digests(module, buffers)
    total = hashlib.blake2b(np.array(digests, dtype=np.int64).tobytes(), digest_size=8)
    summary = _allgather(comm, [len(digests), int.from_bytes(total.digest(), "little",
                                                              signed=True)])
    if (summary == summary[0]).all():
        return
    size = summary.shape[0]
    groups: dict[tuple[int, int], list[int]] = {}
    for r in range(size):
        groups.setdefault(tuple(summary[r].tolist()), []).append(r)
    reference = max(groups.values(), key=lambda g: (len(g), -g[0]))
    diverged = [r for r in range(size) if r not in reference]
    at = f" at step {step}" if step is not None else ""
    lines = [f"replicas diverged{at}: {', '.join(f'r{r}' for r in diverged)} differ from "
             f"r{reference[0]} (agreeing: {', '.join(f'r{r}' for r in reference)})"]
    counts = summary[:, 0]
    if (counts == counts[0]).all():
        table = _allgather(comm, digests)
        ref = table[reference[0]]
        for r in diverged:
            differ = [names[i] for i in np.flatnonzero(table[r] != ref)]
            shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
            lines.append(f"r{r}: {shown}")
    else:
        lines.append("tensor counts differ: " + " ".join(f"r{r}={int(c)}" for r, c in enumerate(counts)))
    lines.append("every rank must start from the same weights (broadcast them from rank 0) "
                 "and apply the same averaged gradients")
    raise ReplicaDivergenceError("\n".join(lines))
