"""Pure tests of the bench's tables, JSON rows, progress bar, data and reference results."""

import io
import json

import numpy as np
import pytest

from mpiring.comm import communicator as comm_module
from mpiring.core.chunking import chunk_bounds
from mpiring.core.ops import finish, reducer
from mpiring.tools.bench import report, sweep
from mpiring.tools.bench.pipeline import chunk_counts, format_chunks_table
from mpiring.tools.bench.ps import format_ps_table


def test_size_sweep_is_nccl_tests_b_e_f():
    assert report.size_sweep(8, 64, 2) == [8, 16, 32, 64]
    assert report.size_sweep(4096, 64 << 20, 2)[-1] == 64 << 20
    assert len(report.size_sweep(4096, 64 << 20, 2)) == 15
    assert report.size_sweep(100, 100, 2) == [100]
    with pytest.raises(ValueError, match="factor"):
        report.size_sweep(8, 64, 1)
    with pytest.raises(ValueError, match="-b"):
        report.size_sweep(64, 8, 2)


def test_row_has_the_documented_keys_and_busbw():
    row = report.make_row("all_reduce", "ring", "mpi", 4, 1 << 20, "float32", 1e-3, 0, count=262144)
    assert set(report.ROW_KEYS) <= set(row)
    assert row["time_us"] == pytest.approx(1000)
    assert row["algbw"] == pytest.approx((1 << 20) / 1e-3 / 1e9)
    assert row["busbw"] == pytest.approx(row["algbw"] * 1.5)  # 2(K-1)/K at K = 4
    bc = report.make_row("broadcast", "native", "mpi", 4, 1000, "float32", 1e-6, 0)
    assert bc["busbw"] == bc["algbw"]


def _rows():
    rows = []
    for algo, t in (("native", 2e-3), ("ring", 1e-3), ("gloo", 4e-3)):
        for n in (4096, 8192):
            rows.append(report.make_row("all_reduce", algo, "mpi", 4, n, "float32", t, 0,
                                        count=n // 4, op="sum", root=None, bound_frac=0.5,
                                        model_us=900.0 if algo == "ring" else None,
                                        model_err=0.11 if algo == "ring" else None))
    report.add_ratios(rows)
    return rows


def test_ratio_to_native():
    rows = _rows()
    assert [r["vs_native"] for r in rows if r["algo"] == "ring"] == [2.0, 2.0]
    assert all(r["vs_native"] == 1.0 for r in rows if r["algo"] == "native")
    assert [r["vs_native"] for r in rows if r["algo"] == "gloo"] == [0.5, 0.5]


def test_table_has_nccl_tests_columns_and_one_block_per_algo():
    text = report.format_table(_rows(), title="all_reduce on 4 ranks", notes=["a note"], model=True)
    lines = text.splitlines()
    header = next(line for line in lines if "count" in line)
    for col in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                "x native", "IQR", "%bound", "model", "error"):
        assert col in header
    assert [line for line in lines if line.startswith("# -- ")] == \
        ["# -- native", "# -- ring", "# -- gloo"]
    data = [line.split() for line in lines if not line.startswith("#")]
    assert len(data) == 6
    ring = data[2]
    assert ring[:5] == ["4096", "1024", "float32", "sum", "-1"]
    assert ring[-5:] == ["2.00", "-", "50%", "900.0", "+11%"]  # no samples: no IQR
    assert data[0][-2:] == ["-", "-"]  # native has no model
    assert "model" not in report.format_table(_rows())
    rows = _rows()
    rows[2].update(vs_native_q1=1.5, vs_native_q3=2.25)
    ring_4k = [line.split() for line in report.format_table(rows).splitlines()
               if not line.startswith("#")][2]
    assert ring_4k[-3:] == ["2.00", "1.50-2.25", "50%"]


def test_paired_quartiles_are_per_iteration_ratios():
    # Iterations 0-3 took turns: a slow spell (iteration 2) slows both alike.
    native = np.array([2.0, 2.0, 20.0, 2.0])
    ring = np.array([1.0, 1.0, 10.0, 4.0])
    q1, q3 = report.paired_quartiles(native, ring)
    assert (q1, q3) == pytest.approx((1.625, 2.0))  # ratios 2, 2, 2, 0.5
    assert report.paired_quartiles(native, native) == (1.0, 1.0)
    lo, hi = report.paired_quartiles(np.array([]), np.array([]))
    assert np.isnan(lo) and np.isnan(hi)


def test_json_rows(tmp_path):
    path = tmp_path / "bench.json"
    report.write_json(str(path), _rows())
    rows = json.loads(path.read_text())
    assert len(rows) == 6
    for r in rows:
        assert set(report.ROW_KEYS) <= set(r)
    with pytest.raises(ValueError, match="lack keys"):
        report.write_json(str(path), [{"collective": "all_reduce"}])


def test_progress_bar():
    assert report.progress_line(0, 4, "x", width=8) == "[........] 0/4 x"
    assert report.progress_line(2, 4, "ring", width=8) == "[####....] 2/4 ring"
    assert report.progress_line(4, 4, "", width=8).startswith("[########] 4/4")
    out = io.StringIO()
    bar = report.Progress(2, stream=out)
    bar.update("a")
    bar.update("b")
    bar.close()
    assert "1/2 a" in out.getvalue() and "2/2 b" in out.getvalue()
    quiet = io.StringIO()
    report.Progress(2, stream=quiet, enabled=False).update("a")
    assert quiet.getvalue() == ""


def test_plot_busbw_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "busbw.png"
    rows = _rows()
    for r in rows:
        r["bound_busbw"] = 3.0
    report.plot_busbw(rows, str(path), title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_algorithms_come_from_the_communicator():
    algos = sweep.resolve_algos(["all_reduce", "broadcast"], None, gloo=True)
    assert algos["all_reduce"] == [*comm_module.ALGOS["all_reduce"], "gloo"]
    assert algos["broadcast"] == [*comm_module.ALGOS["broadcast"], "gloo"]
    assert "gloo" not in sweep.resolve_algos(["all_reduce"], None, gloo=False)["all_reduce"]
    picked = sweep.resolve_algos(["all_reduce", "broadcast"], ["pipelined", "native"], gloo=True)
    assert picked == {"all_reduce": ["native"], "broadcast": ["pipelined", "native"]}
    with pytest.raises(ValueError, match="use one of"):
        sweep.resolve_algos(["all_reduce"], ["tree"], gloo=True)
    with pytest.raises(ValueError, match="unknown collective"):
        sweep.resolve_algos(["alltoall"], None, gloo=True)


def test_sizes_round_to_whole_chunks_for_scatter_and_gather():
    assert sweep.element_count("all_reduce", 1000, 4, 3) == 250
    assert sweep.element_count("reduce_scatter", 1000, 4, 3) == 249
    assert sweep.element_count("all_gather", 8, 4, 4) == 0


@pytest.mark.parametrize("collective", sweep.COLLECTIVES)
@pytest.mark.parametrize("op", ["sum", "max", "prod", "avg"])
def test_reference_matches_a_direct_computation(collective, op):
    k, n, root = 3, 100, 1
    dtype = np.dtype(np.float32)
    inputs = [sweep.rank_data(r, n, dtype, op) for r in range(k)]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        reducer(op)(acc, x)
    finish(op, acc, k)
    bounds = chunk_bounds(n, k)
    for rank in range(k):
        got = sweep.reference(collective, n, k, rank, root, op, dtype)
        if collective == "all_reduce":
            want = acc
        elif collective == "reduce_scatter":
            want = acc[slice(*bounds[rank])]
        elif collective == "all_gather":
            want = np.concatenate([inputs[c][a:b] for c, (a, b) in enumerate(bounds)])
        elif collective == "broadcast":
            want = inputs[root]
        else:
            want = acc if rank == root else acc[:0]
        np.testing.assert_array_equal(got, want)


def test_data_depends_on_rank_and_index():
    a = sweep.rank_data(0, 200, np.dtype(np.int8), "sum")
    b = sweep.rank_data(1, 200, np.dtype(np.int8), "sum")
    assert (a != b).any() and len(set(a[:49].tolist())) > 3
    # A chunk shifted by a power of two is caught: the period is 49.
    assert (a[:64] != a[64:128]).any()
    assert sweep.count_wrong(a, a.copy(), "sum") == 0
    c = a.copy()
    c[5] += 1
    assert sweep.count_wrong(c, a, "sum") == 1
    f = np.array([1.0, 2.0], dtype=np.float32)
    assert sweep.count_wrong(f * (1 + 1e-7), f, "avg") == 0


def test_chunk_counts_and_table():
    assert chunk_counts(1000, s_star=12, max_chunks=64) == [1, 2, 4, 8, 12, 16, 32, 64]
    assert chunk_counts(3) == [1, 2]
    rows = [report.make_row("broadcast", "native", "mpi", 4, 4096, "float32", 5e-4, 0,
                            chunks=None, model_best=4, root=0)]
    for s, t in ((1, 3e-3), (2, 2e-3), (4, 1e-3), (8, 1.5e-3)):
        rows.append(report.make_row("broadcast", "pipelined", "mpi", 4, 4096, "float32", t, 0,
                                    chunks=s, model_best=4, model_us=t * 1e6 / 1.1,
                                    model_err=0.1, root=0))
    text = format_chunks_table(rows)
    line4 = next(line for line in text.splitlines() if line.split()[:1] == ["4"])
    assert "<- measured best" in line4 and "<- model S*" in line4
    assert "measured optimum S = 4; model S* = 4" in text


def test_ps_table_shows_the_lecture_numbers():
    m = 1000
    rows = []
    for k in (2, 4):
        for method, (ws, ss) in (("ring", (2 * (k - 1) * m // k, 2 * (k - 1) * m // k)),
                                 ("ps", (m, (k - 1) * m))):
            rows.append(report.make_row(
                "all_reduce", method, "mpi", k, m, "float32", 1e-3, 0, worker_sent=ws,
                worker_recv=ws, server_sent=ss, server_recv=ss, expect_worker_sent=ws,
                expect_server_recv=ss))
    text = format_ps_table(rows)
    ps4 = next(line for line in text.splitlines() if line.split()[:2] == ["4", "ps"])
    assert ps4.split()[2:6] == ["1.00", "1.00", "3.00", "3.00"]
    ring4 = next(line for line in text.splitlines() if line.split()[:2] == ["4", "ring"])
    assert ring4.split()[2:6] == ["1.50", "1.50", "1.50", "1.50"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_put_every_call_after_every_other_equally_often(n):
    from collections import Counter

    from mpiring.tools.bench.measure import balanced_orders

    rows = balanced_orders(n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    assert len(rows) == (n if n % 2 == 0 or n == 1 else 2 * n)
    for pos in range(n):  # every call in every position equally often
        assert len(set(Counter(row[pos] for row in rows).values())) == 1
    pairs = Counter((row[k], row[k + 1]) for row in rows for k in range(n - 1))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1


def test_speed_summary_marks_the_ratios_under_the_goals_bars(tmp_path, capsys):
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("speed_summary", f"{ROOT}/scripts/speed_summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)

    def row(coll, algo, nbytes, ratio):
        return {"collective": coll, "algo": algo, "ranks": 3, "bytes": nbytes, "time_us": 10.0,
                "vs_native": ratio, "vs_native_q1": ratio - 0.1, "vs_native_q3": ratio + 0.1}

    mib = 1 << 20
    rows = [row("all_reduce", "native", n, 1.0) for n in (8, mib, 2 * mib)]
    rows += [row("all_reduce", "ring", 8, 0.5),          # under 1 MiB: no bar for the ring
             row("all_reduce", "ring", mib, 0.99),       # marked
             row("all_reduce", "ring", 2 * mib, 1.2),
             row("all_reduce", "auto", 8, 0.94),         # marked: auto's bar is 0.95 everywhere
             row("all_reduce", "auto", mib, 0.95),
             row("broadcast", "native", mib, 1.0), row("broadcast", "ring", mib, 0.5),
             row("broadcast", "pipelined", mib, 0.98)]   # marked; the naive ring has no bar
    path = tmp_path / "speed-3.json"
    path.write_text(json.dumps(rows))
    assert summary.main([str(path), "--brief"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["# all_reduce, 3 ranks: 2 ratio(s) under the goals' bars; lowest auto 0.94 at 8 B",
                   "# broadcast, 3 ranks: 1 ratio(s) under the goals' bars; "
                   "lowest pipelined 0.98 at 1 MiB"]
    assert summary.main([str(path), "--from", "1M"]) == 0
    grid = capsys.readouterr().out
    assert "    1 MiB       10.0   0.99<  (0.89-1.09)   0.95   (0.85-1.05)" in grid, grid
    assert "8 B" not in grid and "1 ratio(s) under" in grid
