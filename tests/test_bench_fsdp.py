"""bench-fsdp's counting: FSDP's model state per rank is the ZeRO-3 formula, DDP's 16 Psi."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpiring.tools.bench.fsdp import measure_memory, measure_time, zero3_formula  # noqa: E402
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


def test_time_alternates_and_reports_errors(comm):
    times, errors = measure_time(comm, ["ddp", "fsdp", "nonsense"], CFG, steps=2)
    assert set(times) == {"ddp", "fsdp"} and all(t > 0 for t in times.values())
    assert "nonsense" in errors
