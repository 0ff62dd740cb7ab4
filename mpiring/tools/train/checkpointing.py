"""Checkpoints, resume and replica checks for ``train``: callbacks for ``loop.train``.

``Checkpointer`` writes the job's whole state every ``every`` steps and at the
last step, and ``resume=True`` continues from the newest complete checkpoint,
so that a run killed at any point and resumed ends with the same parameters,
bit for bit, as one that was never interrupted (same flags, same world size,
CPU). ``ReplicaCheck`` hashes the parameters every N steps and raises on every
rank, naming the ranks, if the replicas have diverged.

What a checkpoint holds (``mpiring.parallel.checkpoint``'s format, so
``restore_training_state`` reads it too): the step, the model's and the
optimizer's state (a sharded ZeRO optimizer consolidated first), the sampler's
position (epoch and offset into this epoch's shard) and rank 0's RNG states;
under ``extra``: every rank's RNG states (Python, NumPy, torch, CUDA) and its
tensor-parallel dropout streams, every rank's loss history, the DDP bucket
layout and the rest of the job's state.

Writing: every rank takes part in collecting the state (small Allgathers, and
the consolidation of a sharded optimizer); rank 0 writes the file atomically
(temporary file, fsync, rename, fsync of the directory); the other ranks wait
for it without spinning a core (a polled ``Ibarrier``); then every rank learns
whether the write worked, and a failed write raises on every rank.

Resuming: rank 0 picks the newest complete checkpoint and broadcasts its step
(an integer); every rank loads that same file (the directory must be visible to
every rank, as on a shared file system) and restores its own RNG states (and
TP dropout streams, at the same layout; at another they start from the seed)
and loss history; a failure on any rank raises on every rank.

"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

from mpiring.backends import control as wire
from mpiring.parallel import checkpoint as ck
from mpiring.tools.train import reshard

# Flags that may change between a run and its resumption without changing the
# training itself.
_HARMLESS = ("steps", "log_every", "val_batches")
# Flags that change with the layout: a resume at another layout may change them
# (the global batch, dp x batch_size, is checked through the data position).
_LAYOUT = ("tp", "pp", "fsdp", "optimizer", "mode", "schedule", "microbatches",
           "global_batch", "batch_size", "sequence_parallel", "fused_adamw", "algo",
           "bucket_mb", "first_bucket_mb", "grad_as_bucket_view")


def _global_batch_error(extra, saved, now, batch_size: int) -> str | None:
    """What differs between the checkpoint's global batch and this run's, with the fix."""
    saved_batch = extra["job"]["config"]["batch_size"]
    saved_global = saved["dp"] * saved_batch
    if saved_global == now["dp"] * batch_size:
        return None
    fix = f"--global-batch {saved_global}"
    if saved_global % now["dp"] == 0:
        fix += f" (or --batch-size {saved_global // now['dp']} at {now['dp']} replicas)"
    return (f"the checkpoint's global batch was {saved['dp']} x {saved_batch} windows, this "
            f"run's {now['dp']} x {batch_size}: resume with the same global batch, {fix}")


_MODEL_FLAGS = {"preset": "--preset", "d_model": "--d-model", "n_layers": "--layers",
                "n_heads": "--heads", "seq_len": "--seq-len"}


def model_shape_error(saved_cfg: dict, cfg) -> str | None:
    """How the checkpoint's model (from its run's config) differs in shape from ``cfg``'s,
    naming the flags to resume with; None if the shapes agree (or the config is unknown)."""
    from dataclasses import fields

    from mpiring.tools.models.gpt import PRESETS

    if saved_cfg.get("preset") not in PRESETS:
        return None
    saved = PRESETS[saved_cfg["preset"]].with_(**{k: saved_cfg.get(k) for k in _MODEL_FLAGS
                                                   if k != "preset"})
    now = cfg.model_config()
    shape = [f.name for f in fields(now) if f.name != "dropout"]
    changed = [f"{k} {getattr(saved, k)} -> {getattr(now, k)}" for k in shape
               if getattr(saved, k) != getattr(now, k)]
    if not changed:
        return None
    flags = [f"--preset {saved_cfg['preset']}"] if saved_cfg["preset"] != cfg.preset else []
    flags += [f"{_MODEL_FLAGS[k]} {getattr(saved, k)}" for k in shape
              if k in _MODEL_FLAGS and getattr(saved, k) != getattr(now, k)]
    return (f"the checkpoint's model has another shape ({', '.join(changed)}): resume with "
            f"its model's flags, {' '.join(flags)}")


class ResumeError(RuntimeError):
    """Resuming failed on at least one rank (raised on every rank)."""


class CheckpointWriteError(OSError):
    """Rank 0 could not write a checkpoint (raised on every rank)."""


# --- per-rank state as plain data (JSON between ranks, never pickle) ----------------------

def rng_state_json() -> str:
    """This process's RNG states (Python, NumPy, torch CPU and CUDA) as JSON text."""
    s = ck.rng_state()
    version, internal, gauss = s["python"]
    n = s["numpy"]
    return json.dumps({
        "python": [version, list(internal), gauss],
        "numpy": {"bit_generator": n["bit_generator"], "key": n["key"].tolist(),
                  "pos": n["pos"], "has_gauss": n["has_gauss"], "gauss": n["gauss"]},
        "torch": s["torch"].numpy().tobytes().hex(),
        "cuda": [t.cpu().numpy().tobytes().hex() for t in s.get("cuda", [])],
    })


def set_rng_state_json(text: str) -> None:
    """Restore what ``rng_state_json`` returned."""
    import torch

    d = json.loads(text)

    def tensor(hexed: str):
        return torch.frombuffer(bytearray.fromhex(hexed), dtype=torch.uint8).clone()

    n = d["numpy"]
    state = {
        "python": tuple(d["python"]),
        "numpy": {**n, "key": torch.tensor(n["key"], dtype=torch.int64)},
        "torch": tensor(d["torch"]),
    }
    if d["cuda"]:
        state["cuda"] = [tensor(h) for h in d["cuda"]]
    ck.set_rng_state(state)


def _tp_streams(job) -> dict:
    """The tensor-parallel dropout streams of this rank's model, by name (none: empty)."""
    from mpiring.parallel.tensor.random import named_rng_streams

    model = getattr(job, "tp_model", None)  # a grid job's whole TP model, all its blocks
    return dict(named_rng_streams(job.model if model is None else model))


def tp_streams_json(job) -> dict | None:
    """This rank's TP dropout streams' states as plain data (hex), or None without any."""
    found = {name: {kind: {k: v.numpy().tobytes().hex() for k, v in states.items()}
                    for kind, states in streams.state_dict().items()}
             for name, streams in _tp_streams(job).items()}
    return found or None


def set_tp_streams_json(job, data: dict | None, notes: list[str]) -> None:
    """Restore what ``tp_streams_json`` returned (at the same layout, on the same rank)."""
    import torch

    streams = _tp_streams(job)
    if not streams:
        return
    if data is None:  # a checkpoint from before the streams were saved
        if job.cfg.dropout:
            notes.append("the checkpoint holds no tensor-parallel dropout streams: they start "
                         "again from the seed, so the result will differ from an "
                         "uninterrupted run")
        return
    if set(data) != set(streams):
        raise ValueError(f"the checkpoint's tensor-parallel dropout streams are "
                         f"{sorted(data)}, this model's {sorted(streams)}: resume with the "
                         "checkpoint's model and layout")
    for name, s in streams.items():
        s.load_state_dict({kind: {k: torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8)
                                  for k, h in states.items()}
                           for kind, states in data[name].items()})


def _restore_tp_streams(job, extra: dict, notes: list[str]) -> None:
    ranks = extra.get("tp_streams_ranks")  # absent in checkpoints from before they were saved
    set_tp_streams_json(job, None if ranks is None else ranks[job.comm.rank], notes)


def _quiet_wait(comm) -> None:
    # Rank 0 may take a while to write; the others must not spin a core meanwhile
    # (MPICH busy-polls in blocking calls, and ranks share cores).
    comm.control.barrier(poll_s=0.005)


def _reducer(job):
    return job._our_reducer() if hasattr(job, "_our_reducer") else None


# --- the callbacks --------------------------------------------------------------------------

class Checkpointer:
    """Save the job every ``every`` steps and at its last step; optionally resume first.

    Args:
        directory: where checkpoints go (created with mode 0o700 if missing).
        every: steps between checkpoints; None: only at the last step.
        resume: on start, continue from the newest complete checkpoint in
            ``directory`` (start from step 0 if there is none).
        keep: keep only the newest ``keep`` checkpoints (None: all).
        verbose: rank 0 prints a line per checkpoint written or resumed from.

    Raises:
        ValueError: ``every`` or ``keep`` below 1.
    """

    def __init__(self, directory: str, every: int | None = None, *, resume: bool = False,
                 keep: int | None = None, verbose: bool = True):
        if every is not None and every < 1:
            raise ValueError(f"checkpoint every {every} steps: give at least 1")
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
        self.directory = directory
        self.every = every
        self.resume = resume
        self.keep = keep
        self.verbose = verbose
        self.resumed_from: int | None = None   # the step resumed from, if any
        self.saved: list[tuple[int, float]] = []  # (step, seconds) of every write

    # --- train() callbacks ----------------------------------------------------------
    def on_start(self, job) -> None:
        if self.resume:
            self.load(job)

    def on_step_end(self, job) -> None:
        if (self.every is not None and job.step % self.every == 0) or job.step == job.cfg.steps:
            self.save(job)

    # --- saving -----------------------------------------------------------------------
    def save(self, job) -> str:
        """Write the job's state as a checkpoint of its current step (collective)."""
        comm = job.comm
        t0 = time.perf_counter()
        js = job.state_dict()  # collective with a sharded optimizer
        rngs = wire.allgather_json(comm, rng_state_json())
        # Every TP dropout draws from these, not from torch's generator: without them a
        # resume would replay the first step's masks.
        streams = wire.allgather_json(comm, tp_streams_json(job))
        losses = wire.allgather_array(comm, np.asarray(job.losses, dtype=np.float64))
        global_losses = job.global_mean(job.losses)  # what a resume at any layout continues
        path = os.path.join(self.directory, ck.checkpoint_name(job.step))
        error = None
        if comm.rank == 0:
            import torch

            reducer = _reducer(job)
            state = {
                "format": ck.FORMAT,
                "step": int(js["step"]),
                "model": js["model"],
                "optimizer": js["optimizer"],
                "sampler": js["sampler"],
                "rng": ck.rng_state(),
                "extra": {
                    "world_size": comm.size,
                    "rng_ranks": rngs,
                    "tp_streams_ranks": streams,
                    "losses_ranks": torch.from_numpy(losses),
                    "ddp_layout": reducer.layout_state() if reducer is not None else None,
                    "layout": reshard.layout(job),
                    "param_names": [n for n, _ in job.model.named_parameters()],
                    "global_losses": torch.tensor(global_losses, dtype=torch.float64),
                    "job": {k: v for k, v in js.items()
                            if k not in ("model", "optimizer", "step", "sampler", "losses")},
                },
            }
            try:
                ck.save_checkpoint(self.directory, state, keep=self.keep)
            except Exception as exc:  # every rank must hear of it, or they would go on
                error = f"{type(exc).__name__}: {exc}"
        _quiet_wait(comm)
        error = wire.bcast_json(comm, error, root=0)
        if error is not None:
            raise CheckpointWriteError(f"checkpoint of step {job.step} could not be written to "
                                       f"{self.directory} on rank 0: {error}")
        seconds = time.perf_counter() - t0
        self.saved.append((job.step, seconds))
        if self.verbose and comm.rank == 0:
            size = os.path.getsize(path) / 2**20
            sys.stderr.write(f"checkpoint: step {job.step} -> {path} ({size:.2f} MiB, "
                             f"{seconds * 1e3:.0f} ms)\n")
            sys.stderr.flush()
        return path

    # --- resuming ---------------------------------------------------------------------
    def load(self, job) -> int | None:
        """Restore the newest complete checkpoint into ``job`` (collective).

        Returns the step resumed from, or None if the directory has no checkpoint.

        Raises:
            ResumeError: on every rank, if any rank could not load or restore it.
        """
        comm = job.comm
        step = [-1, None]
        if comm.rank == 0:
            try:  # every file damaged: every rank must fail, not start from step 0
                path = ck.latest_checkpoint(self.directory)
            except ck.CheckpointCorruptError as exc:
                path, step[1] = None, str(exc)
            if path is not None:
                step[0] = int(os.path.basename(path).removeprefix("ckpt-").removesuffix(".pt"))
        # Rank 0 decides which file: ranks listing the directory at different
        # moments (a write in flight) could otherwise pick different ones.
        step = comm.control.bcast_json(step, root=0)
        if step[1] is not None:
            raise ResumeError(f"resume failed: {step[1]}")
        if step[0] < 0:
            if self.verbose and comm.rank == 0:
                sys.stderr.write(f"resume: no checkpoint in {self.directory}, starting at step 0\n")
            return None
        if int(step[0]) > job.cfg.steps:
            # Training would stop at once with the checkpoint's later model: not the run asked for.
            raise ResumeError(f"the newest checkpoint in {self.directory} is of step {step[0]}, "
                              f"past --steps {job.cfg.steps} (the total, not the steps left): "
                              f"resume with --steps {step[0]} or more, or start in another "
                              "--checkpoint-dir")
        path = os.path.join(self.directory, ck.checkpoint_name(int(step[0])))
        error, notes = None, []
        try:
            notes = self._restore(job, ck.load_checkpoint(path))
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
        errors = wire.allgather_json(comm, error)
        if any(e is not None for e in errors):
            lines = [f"r{r}: {e}" for r, e in enumerate(errors) if e is not None]
            raise ResumeError(f"resume from {path} failed:\n" + "\n".join(lines))
        self.resumed_from = int(step[0])
        if self.verbose and comm.rank == 0:
            sys.stderr.write(f"resume: step {self.resumed_from} from {path}\n")
            for note in notes:
                sys.stderr.write(f"resume: {note}\n")
            sys.stderr.flush()
        return self.resumed_from

    def _restore(self, job, state: dict[str, Any]) -> list[str]:
        extra = state.get("extra") or {}
        error = model_shape_error((extra.get("job") or {}).get("config") or {}, job.cfg)
        if error is not None:
            raise ValueError(error)
        saved, now = extra.get("layout"), reshard.layout(job)
        # A grid run on either side moves through the full tensors; two plain
        # data-parallel runs keep the exact path (and its same-world check).
        if saved is not None and "grid" in (saved["kind"], now["kind"]):
            return self._restore_resharded(job, state, saved, now)
        size = extra.get("world_size")
        if size != job.comm.size and saved is not None and saved["tp"] == now["tp"] == 1:
            # Plain DDP (or ZeRO) at another world size: the checkpoint holds the full
            # model and optimizer state, so it loads like a grid one, if the global
            # batch (ranks x --batch-size) is the same.
            error = _global_batch_error(extra, saved, now, job.cfg.batch_size)
            if error is not None:
                raise ValueError(f"the checkpoint was written by {size} ranks, this run has "
                                 f"{job.comm.size} and another global batch: {error}")
            return self._restore_resharded(job, state, saved, now)
        if size != job.comm.size:
            raise ValueError(f"the checkpoint was written by {size} ranks, this run has "
                             f"{job.comm.size}: resume with the same number of ranks, or pass "
                             "--global-batch to reshard it through the 3D grid job")
        notes = []
        saved_cfg = (extra.get("job") or {}).get("config") or {}
        from dataclasses import asdict

        now = asdict(job.cfg)
        changed = [f"{k} {saved_cfg[k]!r} -> {now[k]!r}" for k in sorted(now)
                   if k in saved_cfg and k not in _HARMLESS and saved_cfg[k] != now[k]]
        if changed:
            notes.append("flags differ from the checkpoint's run (" + ", ".join(changed)
                         + "): the result will differ from an uninterrupted run")
        if job.cfg.comm_hook in ("topk", "powersgd"):
            notes.append(f"the {job.cfg.comm_hook} hook's error feedback and step count are not "
                         "in checkpoints: they start afresh, so the result will differ from an "
                         "uninterrupted run")
        rank = job.comm.rank
        js = dict(extra.get("job") or {})
        js.update(model=state["model"], optimizer=state["optimizer"], step=state["step"],
                  sampler=state["sampler"])
        losses = extra.get("losses_ranks")
        js["losses"] = losses[rank].tolist() if losses is not None and losses.numel() else []
        job.load_state_dict(js)
        set_rng_state_json(extra["rng_ranks"][rank])
        _restore_tp_streams(job, extra, notes)
        reducer = _reducer(job)
        layout = extra.get("ddp_layout")
        if reducer is not None and layout is not None:
            reducer.load_layout_state(layout)
        return notes


    def _restore_resharded(self, job, state, saved, now) -> list[str]:
        """Load a checkpoint of another layout (or of a grid job) from its full tensors."""
        extra = state["extra"]
        optim = state["optimizer"]
        if saved["kind"] == "train":
            optim = reshard.by_name(extra["param_names"], optim)
        if now["kind"] == "grid":
            reshard.load_grid_full_state(job, state["model"], optim)
        else:
            job.model.load_state_dict(state["model"])
            if job.optimizer is not None and optim is not None:
                names = [n for n, _ in job.model.named_parameters()]
                job.optimizer.load_state_dict(reshard.by_index(names, optim))
        sampler = dict(state["sampler"])
        read = int(sampler["start"]) * saved["dp"]  # windows the replicas read this epoch
        error = _global_batch_error(extra, saved, now, job.cfg.batch_size)
        if read % now["dp"] or error is not None:
            raise ValueError(error or f"{read} windows read do not split over {now['dp']} "
                             "replicas: resume with the checkpoint's global batch")
        # The position is rescaled here, with the global batch checked: say so, or
        # the sampler would rescale it once more from the saved count.
        job.sampler.load_state_dict({**sampler, "start": read // now["dp"],
                                     "num_replicas": job.sampler.num_replicas})
        job._shard = None
        job.step = int(state["step"])
        job.losses = [float(v) for v in extra["global_losses"].tolist()]
        same = saved == now
        if same:
            notes = []
            set_rng_state_json(extra["rng_ranks"][job.comm.rank])
            _restore_tp_streams(job, extra, notes)
            reducer, ddp = _reducer(job), extra.get("ddp_layout")
            if reducer is not None and ddp is not None:
                reducer.load_layout_state(ddp)
            return notes
        ck.set_rng_state(state["rng"])  # rank 0's: another layout has other ranks
        shape = lambda d: f"dp={d['dp']} x tp={d['tp']} x pp={d['pp']}"  # noqa: E731
        notes = [f"resharded from {shape(saved)} ({saved['world']} ranks) to {shape(now)}"]
        if job.cfg.dropout:
            # Another layout gives the ranks other shards to drop: the TP streams stay as
            # the model built them, from the seed, and the masks cannot match anyway.
            notes.append("dropout draws other masks at another layout (the tensor-parallel "
                         "dropout streams start again from the seed): the result will "
                         "differ from an uninterrupted run")
        saved_cfg = extra["job"]["config"]
        from dataclasses import asdict

        changed = [f"{k} {saved_cfg[k]!r} -> {v!r}" for k, v in sorted(asdict(job.cfg).items())
                   if k in saved_cfg and k not in _HARMLESS + _LAYOUT and saved_cfg[k] != v]
        if changed:
            notes.append("flags differ from the checkpoint's run (" + ", ".join(changed)
                         + "): the result will differ from an uninterrupted run")
        return notes


class ReplicaCheck:
    """Every ``every`` steps, check that every rank holds the same parameters (collective).

    Raises:
        mpiring.parallel.checkpoint.ReplicaDivergenceError: on every rank, naming the
            ranks whose parameters or buffers differ.
    """

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"check replicas every {every} steps: give at least 1")
        self.every = every
        self.checks = 0

    def on_start(self, job) -> None:
        pass

    def on_step_end(self, job) -> None:
        if job.step % self.every == 0:
            # On the grid the replicas are the data-parallel copies of a stage's slice.
            ck.check_replicas(job.model, job.data_comm if hasattr(job, "grid") else job.comm,
                              step=job.step)
            self.checks += 1


# --- flags ------------------------------------------------------------------------------------

def add_arguments(p) -> None:
    """The checkpoint and replica-check flags of ``train``."""
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="write checkpoints (model, optimizer, data position, RNG states, step) "
                        "into DIR, atomically; always one at the last step")
    p.add_argument("--checkpoint-every", type=int, metavar="N", default=None,
                   help="also checkpoint every N steps")
    p.add_argument("--checkpoint-keep", type=int, metavar="K", default=None,
                   help="keep only the newest K checkpoints (default: all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir "
                        "(from step 0 if there is none)")
    p.add_argument("--check-replicas", type=int, metavar="N", default=None,
                   help="every N steps, hash the parameters on every rank and stop, naming "
                        "the ranks, if the replicas diverged")


def callbacks_from_args(args) -> list:
    """The callbacks the flags ask for (replica check first: never save a diverged model).

    Raises:
        ValueError: a flag that needs ``--checkpoint-dir`` without it, or N/K below 1.
    """
    directory = getattr(args, "checkpoint_dir", None)
    every = getattr(args, "checkpoint_every", None)
    keep = getattr(args, "checkpoint_keep", None)
    resume = getattr(args, "resume", False)
    check = getattr(args, "check_replicas", None)
    if directory is None:
        given = [flag for flag, v in (("--checkpoint-every", every), ("--checkpoint-keep", keep),
                                      ("--resume", resume or None)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need(s) --checkpoint-dir DIR")
    callbacks: list = []
    if check is not None:
        callbacks.append(ReplicaCheck(check))
    if directory is not None:
        callbacks.append(Checkpointer(directory, every, resume=resume, keep=keep))
    return callbacks
