"""bench-pp runs end to end (tiny preset, one step): rows, fastest step, drawing."""

from __future__ import annotations

import pytest

from mpiring.tools.bench.pp import draw_run, format_pp_table, run_pp_bench


def test_bench_pp_smoke(comm):
    if comm.size > 2:
        pytest.skip("the bench's layout is 2 stages; the runtime's tests cover more")
    rows, drawn = run_pp_bench(comm, preset="tiny", ms=(2,),
                               modes=("1f1b", "zb", "zb-cap", "gpipe", "interleaved", "zbv",
                                      "1f1b-autograd", "interleaved-zb"),
                               steps=2, warmup=0)
    assert [r["mode"] for r in rows] == ["1f1b", "zb", "zb-cap", "gpipe", "interleaved", "zbv",
                                         "1f1b-autograd", "interleaved-zb"]
    for r in rows:
        assert r["step_ms"] > 0 and 0 <= r["bubble"] < 1 and 0 <= r["predicted"] < 1
        assert 0 <= r["replay"] < 1 and (r["transfer_us"] > 0) == (comm.size > 1)
        assert 0 < r["ideal_ms"] < 2 * r["step_ms"]
        assert 0 <= r["bubble_busiest"] < 1 and 0 <= r["predicted_busiest"] < 1
        # Idle time: the share of the step in milliseconds (the step: the spans' extent).
        assert 0 <= r["idle_busiest_ms"] <= r["idle_ms"] < r["step_ms"]
        assert 0 <= r["predicted_idle_busiest_ms"] <= r["predicted_idle_ms"] < r["ideal_ms"]
        assert r["peak_act_mib"] == max(r["peak_act_mib_per_stage"]) > 0
        assert len(r["peak_act_mib_per_stage"]) == comm.size
        assert (r["preset"], r["ranks"]) == ("tiny", comm.size) and r["mb_rows"] > 0
    assert rows[0]["x_1f1b"] == 1.0
    assert rows[1]["zb_over_1f1b_bubble"] == pytest.approx(rows[1]["bubble"] / rows[0]["bubble"])
    assert rows[1]["zb_over_1f1b_idle_busiest"] == pytest.approx(
        rows[1]["idle_busiest_ms"] / rows[0]["idle_busiest_ms"])
    spans = drawn[("zb", 2)]
    assert len(spans) == comm.size
    assert sorted(s.action.kind for s in spans[0]) == ["B", "B", "F", "F", "W", "W"]
    assert draw_run(spans).count("设备") == comm.size
    # zb-cap: ZB-H1 held to 1F1B's measured peak, to the byte (of what is counted).
    assert rows[2]["peak_act_mib"] <= rows[0]["peak_act_mib"] + 1e-9
    table = format_pp_table(rows)
    assert "zb" in table and "m=2: gpipe meas/pred" in table and "zb/1f1b idle time" in table
    assert "zb-cap/1f1b idle time" in table
    # Interleaved: 2 stages per rank, each rank's spans its own stages' (r and r + p).
    il = drawn[("interleaved", 2)]
    assert {s.action.stage for s in il[comm.rank]} == {comm.rank, comm.rank + comm.size}
    assert rows[4]["il_over_1f1b_bubble"] == pytest.approx(rows[4]["bubble"] / rows[0]["bubble"])
    assert "interleaved/1f1b bubble" in table and "interleaved meas/pred" in table
    # ZB-V: rank r holds stages r and 2p-1-r (rank 0 both ends).
    vee = drawn[("zbv", 2)]
    assert {s.action.stage for s in vee[comm.rank]} == {comm.rank, 2 * comm.size - 1 - comm.rank}
    assert {s.action.kind for s in vee[comm.rank]} == {"F", "B", "W"}
    assert rows[5]["zbv_over_1f1b_idle_busiest"] == pytest.approx(
        rows[5]["idle_busiest_ms"] / rows[0]["idle_busiest_ms"])
    assert "zbv/1f1b idle time" in table and "zbv meas/pred" in table
    # Interleaved zero bubble: the interleaved stages, every backward split.
    izb = drawn[("interleaved-zb", 2)]
    assert {s.action.stage for s in izb[comm.rank]} == {comm.rank, comm.rank + comm.size}
    assert {s.action.kind for s in izb[comm.rank]} == {"F", "B", "W"}
    izb_row, il_row = rows[7], rows[4]  # against interleaved 1F1B's row, not 1F1B's
    assert izb_row["izb_over_il_idle"] == pytest.approx(izb_row["idle_ms"] / il_row["idle_ms"])
    assert (f"interleaved-zb/interleaved idle time {izb_row['izb_over_il_idle']:.2f}, busiest "
            f"rank {izb_row['izb_over_il_idle_busiest']:.2f}") in table
    assert "interleaved-zb meas/pred" in table
    with pytest.raises(ValueError, match="list 1f1b before it"):
        run_pp_bench(comm, preset="tiny", ms=(2,), modes=("zb-cap", "1f1b"))


def test_dualpipev_rows_from_one_micro_batch_per_stage(comm):
    if comm.size > 2:
        pytest.skip("the bench's layout is 2 stages; the runtime's tests cover more")
    ms = (2 * comm.size - 1, 2 * comm.size)  # too few for it, then its least
    rows, drawn = run_pp_bench(comm, preset="tiny", ms=ms, modes=("zbv", "dualpipev"),
                               steps=1, warmup=0)
    assert [(r["mode"], r["m"]) for r in rows] == [("zbv", ms[0]), ("zbv", ms[1]),
                                                   ("dualpipev", ms[1])]
    dual, vee = rows[2], rows[1]
    assert dual["dualpipev_over_zbv_idle_busiest"] == pytest.approx(
        dual["idle_busiest_ms"] / vee["idle_busiest_ms"])
    # Both kinds of backward: split (B, then W) and whole (B alone).
    spans = drawn[("dualpipev", ms[1])][comm.rank]
    assert {s.action.stage for s in spans} == {comm.rank, 2 * comm.size - 1 - comm.rank}
    assert {s.action.kind for s in spans} == {"F", "B", "W"}
    assert sum(s.action.kind == "B" for s in spans) > sum(s.action.kind == "W" for s in spans)
    table = format_pp_table(rows)
    assert "dualpipev meas/pred" in table and "dualpipev/zbv idle time" in table


def test_the_interleaved_mode_needs_two_units_per_rank(comm):
    # tiny has 4 units: 2 ranks x 2 stages fit, 3 do not (named, with the fix).
    from mpiring.tools.bench.pp import interleaved_fits

    assert interleaved_fits("tiny", 2) and not interleaved_fits("tiny", 3)
    if comm.size == 3:
        for mode in ("interleaved", "interleaved-zb", "zbv"):
            with pytest.raises(ValueError, match="leave them out of --modes"):
                run_pp_bench(comm, preset="tiny", ms=(2,), modes=("1f1b", mode))
