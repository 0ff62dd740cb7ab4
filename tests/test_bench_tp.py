"""bench-tp compares like with like: the three modes compute the same block.

Each mode's forward (and the input's gradient) on the same full weights and
input must agree, so the timings compare implementations, not different math.
torch's GPT block holds the fused QKV weight as three column-split linears;
its heads must divide by the ranks (``torch_can_split``).
"""

from __future__ import annotations

import pytest
import torch

from mpiring.tools.bench.tp import (
    TimedComm,
    TPBenchConfig,
    _build,
    bench_device,
    format_table,
    measure,
    torch_can_split,
)

D = 64 * 12  # 12 heads: whole heads on 1, 2, 3 and 4 ranks


def _run(block, mode, world, device="cpu"):
    timed = TimedComm(world)
    model, x, fwd = _build(block, mode, D, 64, world, timed, "ring",
                           bench_device(device, world))
    x = x.clone().requires_grad_()
    y = fwd(x)
    y.float().pow(2).mean().backward()
    if mode != "single" and world.size > 1 and mode == "mpiring":
        assert timed.seconds > 0, "mpiring's TP must move data through the timed collectives"
    if block == "layer" and mode == "mpiring":  # sequence-first in, sequence-first out
        return y.detach().transpose(0, 1), x.grad.transpose(0, 1)
    return y.detach(), x.grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("block", ["mlp", "layer"])
def test_the_modes_compute_the_same_block(world, block, device):
    from mpiring.tools.train.torch_pg import destroy_torch_process_group, init_torch_process_group

    want_y, want_g = _run(block, "single", world, device)
    got_y, got_g = _run(block, "mpiring", world, device)
    torch.testing.assert_close(got_y, want_y, rtol=1e-4, atol=1e-5, msg="mpiring forward")
    torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-7, msg="mpiring input grad")
    if not torch_can_split(block, D, world.size):
        pytest.skip("torch's TP cannot split this block evenly (mpiring's case ran above)")
    init_torch_process_group(world, torch.device(device), backend="gloo")
    try:
        got_y, got_g = _run(block, "torch", world, device)
    finally:
        destroy_torch_process_group(world)
    torch.testing.assert_close(got_y, want_y, rtol=1e-4, atol=1e-5, msg="torch forward")
    torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-7, msg="torch input grad")


def test_heads_must_divide_for_torch_only():
    with pytest.raises(ValueError, match="use cpu"):
        bench_device("tpu", None)
    assert torch_can_split("mlp", 96, 3) and not torch_can_split("mlp", 100, 3)
    assert torch_can_split("layer", 64 * 6, 3) and not torch_can_split("layer", 64 * 4, 3)


def test_measure_and_table(world):
    cfg = TPBenchConfig(widths=[64], blocks=["mlp"], modes=["single", "mpiring"], tokens=64,
                        steps=1, warmup=0)
    rows = [measure(world, cfg, "mlp", m, 64) for m in cfg.modes]
    if world.rank:
        assert rows == [None, None] or rows[0] is None  # only rank 0 reports
        return
    single, tp = rows
    assert single["ranks"] == 1 and tp["ranks"] == world.size
    # A 1/K share, plus the row layer's replicated bias (64 floats) and the
    # rounding of an uneven split (one more fc column with its bias, one more out row).
    assert tp["weight_mib"] <= single["weight_mib"] / world.size + (64 + 65 + 64) * 4 / 2**20
    table = format_table(rows)
    assert "| mlp | 64 |" in table and table.count("\n") == 2
