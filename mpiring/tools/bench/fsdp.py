r"""What fully sharded data parallelism saves and costs: memory per rank and step time.

Model-state memory, counted from the tensors each rank holds after a step:
parameters, gradients and AdamW's two moments (and, for FSDP, the largest set
of gathered parameters seen at once during the step). The ZeRO paper's
formulas, with Psi parameters, K ranks and every state in float32 (4 bytes:
parameter 4, gradient 4, optimizer state 8 per parameter)::

    DDP (baseline)     (4 + 4 + 8) Psi          = 16 Psi
    ZeRO-3 / FSDP      (4 + 4 + 8) Psi / K      = 16 Psi / K    (+ the gathered units)

(the paper's mixed-precision form is (2 + 2 + 12) Psi / N_d). During a step
FSDP also holds gathered parameters and unsharded gradients (counted by FSDP,
``peak_unsharded_bytes``): with ``prefetch=False`` (setup ``fsdp-noprefetch``)
at most the root's and one unit's, 4 B + 4 B each::

    peak in a step <= 16 Psi / K + 8 (Psi_root + Psi_unit)        prefetch off
                      ... + 8 Psi_unit                               prefetch on

(prefetch on: one unit more, its parameters gathered early in forward, or in
backward the next unit's parameters and the last unit's gradient, still
reduce-scattering).

Peak RSS is the process's high-water mark: for it, run one setup per process.

Step time: the setups are built in one process and their steps alternate,
so that a busy machine slows them alike; the median of each is reported and
the ratios are side by side from the same run. Setups: ``ddp`` (mpiring's
DDP + AdamW), ``fsdp`` (mpiring's FSDP + AdamW), ``torch-fsdp`` (torch's
``fully_shard`` on each block and the root, over gloo) and ``torch-zero``
(torch DDP + ``ZeroRedundancyOptimizer`` over gloo, the fallback where torch's
FSDP does not run on the CPU).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from mpiring.tools.bench.memory import current_rss_bytes, peak_rss_bytes

SETUPS = ("ddp", "fsdp", "fsdp-noprefetch", "torch-fsdp", "torch-zero")
STATE_BYTES_PER_PARAM = 4 + 4 + 8  # float32 parameter, gradient, AdamW exp_avg + exp_avg_sq


def zero3_formula(psi: int, k: int, per_param: int = STATE_BYTES_PER_PARAM) -> float:
    """The ZeRO paper's stage-3 model-state bytes per rank: ``per_param * Psi / K``."""
    return per_param * psi / k


def step_formula(psi: int, k: int, psi_root: int, psi_unit: int, prefetch: bool,
                 b: int = 4) -> float:
    """The bound on model state during an FSDP step: ZeRO-3's plus what is unsharded.

    The root's and one unit's parameters and gradients (``b`` bytes each); with
    prefetch one unit more (in backward the next unit is gathered while the
    last one's gradient is still being reduce-scattered).
    """
    units = 2 if prefetch else 1
    return zero3_formula(psi, k) + 2 * b * (psi_root + units * psi_unit)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def model_state_bytes(params, opt) -> int:
    """Parameters + gradients + optimizer state tensors this rank holds."""
    params = list(params)
    state = [v for st in opt.state.values() for v in st.values()
             if torch.is_tensor(v) and v.dim() > 0]
    return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + tensor_bytes(state)


def _batch(cfg, step: int, rank: int, size: int, batch_size: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


class Setup:
    """One model, wrapped one way, with its AdamW; ``step()`` trains one step."""

    def __init__(self, name: str, comm, cfg, batch_size: int, pg=None, algo: str | None = None):
        from mpiring.tools.models.gpt import GPT, lm_loss

        self.name, self.comm, self.cfg, self.batch_size = name, comm, cfg, batch_size
        self.loss = lm_loss
        torch.manual_seed(0)
        model = GPT(cfg)
        self.psi = model.num_params()
        self.gathered_peak = 0
        self.closers = []
        if name == "ddp":
            from mpiring.parallel.data.distributed import DistributedDataParallel

            self.model = DistributedDataParallel(model, comm)
            self.closers.append(self.model.close)
            params = list(model.parameters())
        elif name in ("fsdp", "fsdp-noprefetch"):
            from mpiring.parallel.fsdp import FullyShardedDataParallel

            self.model = FullyShardedDataParallel(model, comm, prefetch=name == "fsdp",
                                                  **({"algo": algo} if algo else {}))
            self.closers.append(self.model.close)
            params = list(self.model.parameters())
            for u in self.model.units[1:]:  # runs after FSDP's own pre-hook: gathered
                u.module.register_forward_pre_hook(lambda m, a: self._sample())
        elif name == "torch-fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (comm.size,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
            params = list(model.parameters())
        elif name == "torch-zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.model = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
            params = list(model.parameters())
            self.opt = ZeroRedundancyOptimizer(params, torch.optim.AdamW, process_group=pg,
                                               lr=1e-3)
        else:
            raise ValueError(f"unknown setup {name!r}: use one of {', '.join(SETUPS)}")
        self.params = params
        if name != "torch-zero":
            self.opt = torch.optim.AdamW(params, lr=1e-3)
        self.times: list[float] = []
        self._step = 0
        self.unsharded_peak = 0  # FSDP: gathered parameters + pending gradients, in a step

    def _sample(self) -> None:
        live = sum(u.flat.full.untyped_storage().nbytes() for u in self.model.units)
        self.gathered_peak = max(self.gathered_peak, live)

    def step(self) -> float:
        x, y = _batch(self.cfg, self._step, self.comm.rank, self.comm.size, self.batch_size)
        self._step += 1
        fsdp = self.name.startswith("fsdp")
        if fsdp:
            self.model.reset_peak()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        if fsdp:
            self.unsharded_peak = max(self.unsharded_peak, self.model.peak_unsharded_bytes)
        self.times.append(dt)
        return float(loss.detach())

    def state_bytes(self) -> int:
        """Model state per rank; torch's FSDP shards are DTensors: count their local parts."""
        if self.name == "torch-fsdp":
            local = [getattr(p, "_local_tensor", p) for p in self.params]
            grads = [getattr(p.grad, "_local_tensor", p.grad) for p in self.params]
            state = [getattr(v, "_local_tensor", v) for st in self.opt.state.values()
                     for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
            return tensor_bytes(local) + tensor_bytes(grads) + tensor_bytes(state)
        return model_state_bytes(self.params, getattr(self.opt, "optim", self.opt))

    def close(self) -> None:
        for c in self.closers:
            c()


def measure_memory(comm, setup: str, cfg, *, steps: int = 3, batch_size: int = 2) -> dict[str, Any]:
    """One setup in this process: counted model state, the formula, peak RSS (this rank)."""
    before = current_rss_bytes()
    s = Setup(setup, comm, cfg, batch_size)
    for _ in range(steps):
        s.step()
    row = {"setup": setup, "ranks": comm.size, "psi": s.psi, "state_bytes": s.state_bytes(),
           "gathered_peak": s.gathered_peak, "ddp_formula": STATE_BYTES_PER_PARAM * s.psi,
           "zero3_formula": zero3_formula(s.psi, comm.size),
           "unsharded_peak": s.unsharded_peak,
           "rss_before": before, "rss_peak": max(peak_rss_bytes(), current_rss_bytes())}
    if setup.startswith("fsdp"):
        units = s.model.units
        row["psi_root"] = units[0].flat.numel
        row["psi_unit"] = max((u.flat.numel for u in units[1:]), default=0)
        row["step_peak"] = row["state_bytes"] + s.unsharded_peak
        row["step_formula"] = step_formula(s.psi, comm.size, row["psi_root"], row["psi_unit"],
                                           prefetch=setup == "fsdp")
    s.close()
    return row


def measure_time(comm, setups: list[str], cfg, *, steps: int = 6, batch_size: int = 2,
                 pg=None, algo: str | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """Alternate the setups' steps; median seconds per step (first excluded), and errors."""
    built, errors = [], {}
    for name in setups:
        try:
            built.append(Setup(name, comm, cfg, batch_size, pg=pg, algo=algo))
        except Exception as exc:  # shown to the user: torch's FSDP may not run here
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    # Every rank must have built the same setups before any step runs.
    ok = comm.control.allgather_json(sorted(s.name for s in built))
    common = set(ok[0]).intersection(*map(set, ok))
    built = [s for s in built if s.name in common]
    for _ in range(steps):
        for s in built:
            try:
                s.step()
            except Exception as exc:
                raise RuntimeError(f"setup {s.name} failed in a step: {exc}") from exc
    mine = {s.name: statistics.median(s.times[1:] or s.times) for s in built}
    table = comm.control.allgather_json(mine)
    for s in built:
        s.close()
    return {n: max(t[n] for t in table) for n in mine}, errors
