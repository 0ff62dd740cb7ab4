"""The DDP bench: a one-step run of every mode on the tiny GPT, and its table and bars."""

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from conftest import wait_quietly  # noqa: E402

from mpiring.tools.bench.ddp import (  # noqa: E402
    PARTS,
    DDPBenchConfig,
    format_ddp_table,
    plot_ddp,
    run_ddp_bench,
)


@pytest.mark.deadline(120)
def test_every_mode_splits_its_step(world, tmp_path):
    cfg = DDPBenchConfig(preset="tiny", batch_size=2, steps=1, warmup=1,
                         modes=("compute", "ddp", "naive", "flat-mpi", "ps"), bucket_sweep=(0.05,),
                         max_data_mb=0.25)
    rows = run_ddp_bench(world, cfg)
    assert [(r["mode"], r["bucket_mb"]) for r in rows] == [
        ("compute", None), ("ddp", 25.0), ("naive", 25.0), ("flat-mpi", None), ("ps", 25.0),
        ("ddp", 0.05)]
    for r in rows:
        assert r["step_ms"] > 0 and r["forward_ms"] > 0
        assert all(r[f"{p}_ms"] >= 0 for p in PARTS)
        # The parts add up to the mean step (the reported step is the slowest rank's).
        assert sum(r[f"{p}_ms"] for p in PARTS) <= r["step_ms"] * 1.5 + 1
    compute, ddp, naive, flat, ps, small = rows
    assert compute["exposed_ms"] == 0 and compute["vs_compute"] == 1
    if world.size > 1:
        for r in (ddp, naive, small):  # bucket AllReduce times come from the reducer's events
            assert r["comm_total_ms"] > 0 and 0 <= r["overlap"] <= 1
        assert ps["exposed_ms"] > 0 and ps["optimizer_ms"] == 0
        assert flat["exposed_ms"] > 0 and flat["comm_total_ms"] > 0 and flat["overlap"] == 0
    text = format_ddp_table(rows)
    assert "compute" in text and "ddp 0.05M" in text and "overlap" in text
    try:
        if world.rank == 0:
            plot_ddp(rows, str(tmp_path / "ddp.png"))
            assert (tmp_path / "ddp.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        wait_quietly(world)  # the others sleep instead of spinning on rank 0's core


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="use one of"):
        DDPBenchConfig(modes=("fast",)).validate()
    with pytest.raises(ValueError, match="positive"):
        DDPBenchConfig(bucket_sweep=(0,)).validate()


@pytest.mark.deadline(120)
def test_memory_setups_report_peak_rss_and_extra_copies(world):
    from mpiring.tools.bench.memory import SETUPS, format_memory_line, measure_setup, memory_table

    rows = [measure_setup(world, s, preset="tiny", steps=2, max_data_mb=0.25)
            for s in ("compute", "ddp", "ddp-view")]
    for r, s in zip(rows, ("compute", "ddp", "ddp-view")):
        assert r["setup"] == s and r["ranks"] == world.size
        assert r["rss_peak"] >= r["rss_before"] > 0 and r["grad_bytes"] > 0
        assert f"setup={s}" in format_memory_line(r)
    table = memory_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and "| compute | " in table[2] and "+0.00 |" in table[2]
    with pytest.raises(ValueError, match="use one of"):
        measure_setup(world, "zero3")
    assert "torch-ddp-view" in SETUPS


@pytest.mark.deadline(90)
def test_command_header_says_how_memory_was_set_up(rank0_subprocess):
    """The header names the allocator state, the buckets' pages and the optimizer, then the table."""
    args = ["-m", "mpiring", "bench-ddp", "--preset", "tiny", "--batch-size", "1", "-n", "1",
            "-w", "0", "--modes", "compute,ddp", "--max-data-mb", "0.2"]
    result = rank0_subprocess(2, args, timeout=60)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 0, out
    header = next(line for line in out.splitlines() if line.startswith("# malloc: "))
    ours = os.environ.get("MPIRING_STEADY_MALLOC", "1").strip() == "0" or any(
        k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                  "GLIBC_TUNABLES"))
    want = "# malloc: as the environment left it" if ours else "# malloc: glibc's thresholds fixed"
    assert header.startswith(want), header
    assert "; DDP buckets: " in header and "pages" in header, header
    from mpiring.tools.train.loop import fused_adamw_available

    fused = fused_adamw_available("cpu")
    assert header.endswith("; optimizer: AdamW" + (" (fused)" if fused else "")), header
    assert "bucket AllReduce algo ring-seg" in out, out
    assert out.count("compute ") == 1 and "ddp 25M" in out, out
