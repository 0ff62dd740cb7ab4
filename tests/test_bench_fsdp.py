"""bench-fsdp's counting: FSDP's model state per rank is the ZeRO-3 formula, DDP's 16 Psi."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpiring.tools.bench.fsdp import (  # noqa: E402
    measure_memory,
    measure_time,
    step_formula,
    zero3_formula,
)
from mpiring.tools.models.gpt import PRESETS  # noqa: E402

CFG = PRESETS["tiny"].with_(d_model=16, n_heads=2, seq_len=8)


def test_formula():
    assert zero3_formula(1000, 4) == 4000.0
    assert zero3_formula(10, 3, per_param=12) == 40.0


def test_counted_state_matches_the_formula(comm):
    fsdp = measure_memory(comm, "fsdp", CFG, steps=1)
    ddp = measure_memory(comm, "ddp", CFG, steps=1)
    assert ddp["state_bytes"] == ddp["ddp_formula"] == 16 * ddp["psi"]
    # Each unit's shard is within one element of Psi_unit / K.
    units = 1 + CFG.n_layers
    assert abs(fsdp["state_bytes"] - fsdp["zero3_formula"]) <= 16 * units
    assert 0 < fsdp["gathered_peak"] <= 2 * 4 * fsdp["psi"] / CFG.n_layers


def test_step_formula():
    assert step_formula(1000, 4, 10, 100, prefetch=False) == 4000 + 8 * 110
    assert step_formula(1000, 4, 10, 100, prefetch=True) == 4000 + 8 * 210


def test_prefetch_off_holds_one_unit_in_a_step(comm):
    """Without prefetch: the root's and one unit's parameters and gradient, the ZeRO-3 bound."""
    lean = measure_memory(comm, "fsdp-noprefetch", CFG, steps=2)
    fast = measure_memory(comm, "fsdp", CFG, steps=2)
    assert lean["state_bytes"] == fast["state_bytes"]
    one = 4 * (lean["psi_root"] + lean["psi_unit"])
    assert 0 < lean["gathered_peak"] <= one  # parameters: the root and one unit
    assert lean["unsharded_peak"] <= 2 * one  # ... and their gradients
    assert lean["step_peak"] <= lean["step_formula"]
    assert fast["step_peak"] <= fast["step_formula"]
    # Prefetch gathers the next unit early: one unit's parameters more at once.
    assert fast["gathered_peak"] >= lean["gathered_peak"] + 4 * lean["psi_unit"]


def test_time_alternates_and_reports_errors(comm):
    times, errors = measure_time(comm, ["ddp", "fsdp", "fsdp-noprefetch", "nonsense"], CFG,
                                 steps=2)
    assert set(times) == {"ddp", "fsdp", "fsdp-noprefetch"} and all(t > 0 for t in times.values())
    assert "nonsense" in errors
