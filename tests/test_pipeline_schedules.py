"""Pipeline schedules as data, without MPI: generators, validator, simulated bubble, diagram.

Pure functions: every rank of a test job runs them alike (no communication).
"""

from __future__ import annotations

import pytest

from mpiring.parallel.pipeline import diagram
from mpiring.parallel.pipeline.actions import Action, format_schedule, parse, parse_schedule
from mpiring.parallel.pipeline.schedules import (
    GENERATORS,
    MULTI,
    build,
    compute_only,
    dump_csv,
    load_csv,
    stage_ranks,
)
from mpiring.parallel.pipeline.validate import (
    ScheduleError,
    bubble,
    check,
    idle_time,
    in_flight,
    predicted_bubble,
    simulate,
    unit_costs,
)

pytestmark = pytest.mark.one_rank  # pure: rank 0 runs them (tests/mpi_harness.py)

STAGES = (1, 2, 3, 4, 5)
MICRO = (1, 2, 3, 4, 8, 16)


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO)
def test_every_schedule_is_valid_and_complete(name, p, m):
    sched = build(name, p, m)
    check(sched, m)
    for i, prog in enumerate(sched):
        comp = compute_only(prog)
        assert sorted(a.mb for a in comp if a.kind == "F") == list(range(m))
        assert sorted(a.mb for a in comp if a.kind == "B") == list(range(m))
        ws = [a.mb for a in comp if a.kind == "W"]
        assert sorted(ws) == (list(range(m)) if name == "zb" else [])
        assert all(a.stage == i for a in prog)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO)
def test_bubble_is_the_formula(name, p, m):
    # Equal F and B (a whole backward), the lecture's assumption: (p-1)/(m+p-1).
    for costs in (unit_costs(1, 1, 1), unit_costs(1, 2, 0), unit_costs(2, 1, 1)):
        spans = simulate(build(name, p, m), costs)
        for frac in bubble(spans):
            assert frac == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO)
def test_gpipe_bubble_with_a_transfer_step(p, m):
    # Each message takes tau from its send to its receive: the fill and the drain
    # each grow by (p-1) tau, so the bubble is (p-1)(1+tau)/(m+(p-1)(1+tau)).
    tau = 0.25
    spans = simulate(build("gpipe", p, m), unit_costs(1, 1, 0), transfer=tau)
    fill = (p - 1) * (1 + tau)
    for frac in bubble(spans):
        assert frac == pytest.approx(fill / (m + fill))
    assert bubble(simulate(build("gpipe", p, m), transfer=0.0)) == bubble(
        simulate(build("gpipe", p, m)))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("p", (2, 3, 4))
def test_prediction_replays_a_run(name, p):
    # A "run" with uneven, micro-batch-dependent times: replaying each action's own
    # time reproduces its bubble exactly; the stage means only approximately.
    m = 6
    sched = build(name, p, m)

    def cost(a, split):
        return {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}[a.kind] * (1 + 0.3 * (a.mb % 3)
                                                                          + 0.2 * a.stage)
    run = simulate(sched, cost, transfer=0.1)
    assert predicted_bubble(sched, run, transfer=0.1, replay=True) == pytest.approx(bubble(run))
    assert predicted_bubble(sched, run, replay=True) != pytest.approx(bubble(run))
    means = predicted_bubble(sched, run, transfer=0.1)
    assert max(means) == pytest.approx(max(bubble(run)), rel=0.5)


@pytest.mark.parametrize("p", (2, 3, 4, 5))
@pytest.mark.parametrize("m", (5, 8, 16))
def test_zero_bubble_is_a_third_of_1f1b(p, m):
    costs = unit_costs(1, 1, 1)
    zb = idle_time(simulate(build("zb", p, m), costs))
    ofb = idle_time(simulate(build("1f1b", p, m), costs))
    for a, b in zip(zb, ofb):
        assert a == pytest.approx((p - 1) * (1 + 1 - 1))   # (p-1)(F+B-W)
        assert b == pytest.approx((p - 1) * 3)             # (p-1)(F+B+W)
        assert a <= b / 3 + 1e-9
    # As a fraction of the ideal compute m(F+B+W) (the zero-bubble README's rate): B/3.
    assert max(zb) / (3 * m) == pytest.approx(((p - 1) / m) / 3)


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO)
def test_activations_in_flight(p, m):
    for i in range(p):
        assert in_flight(build("gpipe", p, m)[i]) == m
        assert in_flight(build("1f1b", p, m)[i]) == min(p - i, m)
    # ZB-H1: never more than 1F1B's peak (stage 0's).
    assert max(in_flight(x) for x in build("zb", p, m)) == min(p, m)


def test_action_strings_round_trip():
    sched = build("zb", 3, 4)
    assert parse_schedule(format_schedule(sched)) == sched
    assert str(Action(2, "F", 0)) == "2F0" and parse("1SEND_B3") == Action(1, "SEND_B", 3)
    assert parse("1SEND_B3").peer == 0 and parse("1RECV_B3").peer == 2
    with pytest.raises(ValueError, match="STAGE KIND MB"):
        parse("F1")
    with pytest.raises(ValueError, match="unknown action kind"):
        Action(0, "X", 0)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_csv_round_trip_and_torch_compute_only(tmp_path, name):
    # Ours back as it was; torch's compute-only layout (its I for the input's backward,
    # an empty cell for an idle slot) read and lowered to the same programs.
    sched = build(name, 3, 4)
    path = tmp_path / f"{name}.csv"
    dump_csv(sched, path)
    assert load_csv(path) == sched
    torch_rows = [",".join([str(a).replace("B", "I") if name == "zb" else str(a)
                            for a in compute_only(program)] + [""]) for program in sched]
    (tmp_path / "torch.csv").write_text("\n".join(torch_rows) + "\n")
    assert load_csv(tmp_path / "torch.csv") == sched
    (tmp_path / "bad.csv").write_text("0F0,0X1\n")
    with pytest.raises(ValueError, match=r"bad.csv: row 1, column 2: cannot read '0X1'"):
        load_csv(tmp_path / "bad.csv")


def _swap(rows: list[str], r: int, a: str, b: str) -> list[str]:
    toks = rows[r].split()
    i, j = toks.index(a), toks.index(b)
    toks[i], toks[j] = toks[j], toks[i]
    return rows[:r] + [" ".join(toks)] + rows[r + 1:]


def test_validator_refuses_broken_schedules():
    rows = format_schedule(build("1f1b", 2, 2))
    # B before its F.
    bad = _swap(rows, 0, "0F1", "0B1")
    with pytest.raises(ScheduleError, match="needs 0F1 earlier"):
        check(parse_schedule(bad), 2)
    # W before its B.
    zrows = format_schedule(build("zb", 2, 2))
    with pytest.raises(ScheduleError, match="needs 1B0 earlier"):
        check(parse_schedule(_swap(zrows, 1, "1B0", "1W0")), 2)
    # A send with no receive: the last stage drops one RECV_F (and its F with it).
    dropped = [rows[0], rows[1].replace("1RECV_F1 ", "")]
    with pytest.raises(ScheduleError, match="needs 1RECV_F1"):
        check(parse_schedule(dropped), 2)
    # Messages in an order the receiver does not expect.
    crossed = _swap(rows, 0, "0SEND_F0", "0SEND_F1")
    with pytest.raises(ScheduleError):
        check(parse_schedule(crossed), 2)
    # Micro-batch out of range, a stage on the wrong rank.
    with pytest.raises(ScheduleError, match="out of range"):
        check(parse_schedule(rows), 1)
    with pytest.raises(ScheduleError, match="runs on rank"):
        check(parse_schedule([rows[1], rows[0]]), 2)


def test_validator_finds_a_deadlock():
    # Both stages wait for each other: stage 0 receives B0 before it sends F0's output.
    rows = ["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits in 0RECV_B0"):
        simulate(parse_schedule(rows))
    # Posted together in one group, the same two messages are fine.
    ok = ["0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"]
    simulate(parse_schedule(ok), rendezvous=True)


def test_rendezvous_model_is_stricter():
    # Each rank sends, computes, then receives what the other sent. With MPI's
    # isend the sends never hold anyone up; where a send completes only once it
    # is received (NCCL), each rank waits in its send for the other's receive.
    prog = parse_schedule(["0SEND_F0 0F1 0RECV_B0", "1SEND_B0 1F1 1RECV_F0"])
    simulate(prog)
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits in 0SEND_F0"):
        simulate(prog, rendezvous=True)


def test_diagram_draws_the_lecture():
    text = diagram.draw_schedule(build("gpipe", 3, 3), w=0)
    lines = text.splitlines()
    assert lines[0].startswith("设备 1: [F1][F2][F3]")
    assert lines[1].startswith("设备 2:     [F1][F2][F3]")
    assert lines[2].startswith("设备 3:         [F1][F2][F3][B1][B2][B3]")
    for line in lines:
        assert line.endswith("bubble 40%")  # (p-1)/(m+p-1) = 2/5
    zb = diagram.draw_schedule(build("zb", 2, 4)).splitlines()
    assert "[W1]" in zb[0] and "[B1]" in zb[1]


# --- interleaved 1F1B: several stages per rank ---------------------------------------

@pytest.mark.parametrize("p", (1, 2, 3, 4, 5, 6))
@pytest.mark.parametrize("v", (2, 3, 4))
def test_interleaved_is_valid_for_every_micro_batch_count(p, v):
    # m need not be a multiple of p: rounds of near-equal size (a short last round
    # deadlocks, e.g. p=4, v=3, m=5 with rounds of 4 + 1).
    for m in range(1, 33):
        sched = build("interleaved", p, m, v)
        check(sched, m, p * v, rendezvous=False)
        for r, prog in enumerate(sched):
            assert {a.stage for a in prog} == set(range(r, p * v, p))
            for s in range(r, p * v, p):
                comp = [a for a in compute_only(prog) if a.stage == s]
                assert sorted(a.mb for a in comp if a.kind == "F") == list(range(m))
                assert sorted(a.mb for a in comp if a.kind == "B") == list(range(m))
        # Never a longer bubble than 1F1B's on the same ranks, with each stage 1/v of one.
        ours = max(bubble(simulate(sched, unit_costs(1, 2, 0))))
        plain = max(bubble(simulate(build("1f1b", p, m), unit_costs(1, 2, 0))))
        assert ours <= plain + 1e-12, (m, ours, plain)


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("v", (2, 3))
@pytest.mark.parametrize("rounds", (1, 2, 4))
def test_interleaved_bubble_is_the_formula(p, v, rounds):
    # Narayanan et al.: v stages per rank divide the warm-up's wait by v, so with m a
    # multiple of p the bubble is (p-1)/(vm+p-1) of the step (1F1B: (p-1)/(m+p-1)).
    m = rounds * p
    for costs in (unit_costs(1, 2, 0), unit_costs(2, 1, 0)):
        for frac in bubble(simulate(build("interleaved", p, m, v), costs)):
            assert frac == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("m", (4, 8, 16))
def test_interleaved_activations_in_flight(p, m):
    # Megatron's warm-up, (v-1)p + 2(p-1-r) forwards before the first backward, plus
    # the steady state's one: rank 0 holds the most, each a stage of 1/v of the rank.
    v = 2
    sched = build("interleaved", p, m, v)
    rounds = max(1, m // p)
    size = -(-m // rounds)
    for r, prog in enumerate(sched):
        assert in_flight(prog) == min(m * v, (v - 1) * size + 2 * (p - 1 - r) + 1)


def test_interleaved_with_one_stage_per_rank_is_1f1b():
    assert build("interleaved", 3, 5, 1) == build("1f1b", 3, 5)
    with pytest.raises(ValueError, match="use one of 'interleaved', 'interleaved-zb', 'zbv', "
                                         "'dualpipev', 'looped-bfs' for several stages per "
                                         "rank"):
        build("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="stages_per_rank=0"):
        build("interleaved", 2, 4, 0)


def test_interleaved_sends_cross_so_only_mpi_runs_it():
    # NCCL matches a pair of ranks' messages in order whatever the stage: the
    # rendezvous model refuses the schedule, MPI's (isend) runs it.
    sched = build("interleaved", 2, 4, 2)
    check(sched, 4, 4, rendezvous=False)
    with pytest.raises(ScheduleError, match="deadlock"):
        check(sched, 4, 4)


def test_validator_places_several_stages_per_rank():
    rows = format_schedule(build("interleaved", 2, 2, 2))
    # Rank 0 runs stages 0 and 2; a stage 1 action there is refused, and so is a
    # stage count that does not divide among the ranks.
    bad = [rows[0].replace("0F0", "1F0", 1), rows[1]]
    with pytest.raises(ScheduleError, match="stage 1 runs on rank 1, not 0"):
        check(parse_schedule(bad), 2, 4, rendezvous=False)
    with pytest.raises(ScheduleError, match="3 stages on 2 ranks"):
        check(parse_schedule(rows), 2, 3, rendezvous=False)
    # Dropping stage 2's forward of micro-batch 1 leaves it never run.
    toks = [t for t in rows[0].split() if t not in ("2F1", "2RECV_F1", "2SEND_F1")]
    with pytest.raises(ScheduleError, match="needs 2F1 earlier|never runs 2F1"):
        check(parse_schedule([" ".join(toks), rows[1]]), 2, 4, rendezvous=False)


def test_diagram_marks_each_stage_of_a_rank():
    text = diagram.draw_schedule(build("interleaved", 2, 2, 2), w=0)
    first = text.splitlines()[0]
    assert first.startswith("设备 1: [F1 ][F2 ][F1'][F2']"), first


def test_the_docs_draw_what_the_code_draws():
    import pathlib
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "pipeline.md").read_text()
    for name in ("interleaved", "interleaved-zb", "zbv", "dualpipev"):
        text = diagram.draw_schedule(build(name, 2, 4, 2), f=1, b=1, w=1, chars_per_unit=5)
        for line in text.splitlines():
            assert line in doc, line


# --- interleaved zero bubble: the interleaved order, the backward split --------------

@pytest.mark.parametrize("p", (1, 2, 3, 4, 5, 6))
@pytest.mark.parametrize("v", (2, 3, 4))
def test_interleaved_zb_is_valid_and_never_idles_more(p, v):
    for m in range(1, 33):
        sched = build("interleaved-zb", p, m, v)
        check(sched, m, p * v, rendezvous=False)
        plain = build("interleaved", p, m, v)
        for r, prog in enumerate(sched):
            for s in range(r, p * v, p):
                comp = [a for a in compute_only(prog) if a.stage == s]
                for kind in "FBW":  # every B split, its W after it (the check's order)
                    assert sorted(a.mb for a in comp if a.kind == kind) == list(range(m))
        # No more micro-batches in flight than interleaved 1F1B at its peak rank, and
        # never a longer wait, with B or W the longer.
        assert max(map(in_flight, sched)) <= max(map(in_flight, plain)), m
        if m not in (1, 2, 3, 5, 8, 13, 32):
            continue
        for costs in (unit_costs(1, 2, 1), unit_costs(1, 1, 2)):
            ours, theirs = idle_time(simulate(sched, costs)), idle_time(simulate(plain, costs))
            assert max(ours) <= max(theirs) + 1e-9, (m, ours, theirs)


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("v", (2, 3))
@pytest.mark.parametrize("rounds", (1, 2, 4))
def test_interleaved_zb_idles_a_third_of_interleaved(p, v, rounds):
    # ZB-H1's (p-1)(F+B-W) against (p-1)(F+B+W), on every rank, with equal F, B and W.
    m = rounds * p
    ours = idle_time(simulate(build("interleaved-zb", p, m, v), unit_costs(1, 1, 1)))
    plain = idle_time(simulate(build("interleaved", p, m, v), unit_costs(1, 1, 1)))
    assert max(ours) == pytest.approx(max(plain) / 3)
    # One forward per rank downstream in the warm-up (a split B comes back sooner), and
    # rank r's r held-back W's: (v-1)p + p on every rank, as ZB-H1's p on every stage.
    for prog in build("interleaved-zb", p, m, v):
        assert in_flight(prog) == min(m * v, (v - 1) * p + p)


def test_interleaved_zb_with_one_stage_per_rank_is_zb_h1():
    assert build("interleaved-zb", 3, 5, 1) == build("zb", 3, 5)
    # Rank r holds back r W's: after its last B come the W's of its last r B's (and
    # the W of the B just before them, the steady state's).
    for r, prog in enumerate(build("interleaved-zb", 3, 6, 2)):
        comp = compute_only(prog)
        last_b = max(i for i, a in enumerate(comp) if a.kind == "B")
        bs = [(a.stage, a.mb) for a in comp if a.kind == "B"]
        tail = [(a.stage, a.mb) for a in comp[last_b + 1:]]
        assert tail == bs[len(bs) - 1 - r:], (r, tail)


# --- ZB-V: two stages per rank, in a V ---------------------------------------------

@pytest.mark.parametrize("p", (1, 2, 3, 4, 5, 6))
def test_zbv_is_valid_and_complete_for_every_micro_batch_count(p):
    ranks = stage_ranks(p, 2 * p, "v")
    assert ranks == list(range(p)) + list(reversed(range(p)))
    for m in range(1, 25):
        sched = build("zbv", p, m, 2)
        check(sched, m, 2 * p, rendezvous=False, ranks=ranks)
        for r, prog in enumerate(sched):
            assert {a.stage for a in prog} == {r, 2 * p - 1 - r}
            for s in (r, 2 * p - 1 - r):
                comp = [a for a in compute_only(prog) if a.stage == s]
                for kind in "FBW":  # every B split, its W after it
                    assert sorted(a.mb for a in comp if a.kind == kind) == list(range(m))
            # 1F1B's stage-0 count: p micro-batches of a stage twice as large.
            assert in_flight(prog) <= 2 * p


@pytest.mark.parametrize("p", (1, 2, 3, 4, 5))
@pytest.mark.parametrize("m", (1, 2, 3, 5, 8, 16))
def test_zbv_idles_only_for_the_lead(p, m):
    # Equal F, B, W per stage (a stage is half a rank's share): the last rank waits p-1
    # forwards for its first input and, with m >= 2p, nothing else; ZB-H1 on stages
    # twice the size idles (p-1)(F+B-W), twice that; 1F1B (p-1)(F+B+W), six times.
    zbv = idle_time(simulate(build("zbv", p, m, 2), unit_costs(1, 1, 1)))
    zb = idle_time(simulate(build("zb", p, m), unit_costs(2, 2, 2)))
    ofb = idle_time(simulate(build("1f1b", p, m), unit_costs(2, 2, 2)))
    for a, b in zip(zbv, zb):
        assert a <= b + 1e-9
    if m >= 2 * p:
        assert zbv == pytest.approx([p - 1] * p)
        assert max(zb) == pytest.approx(2 * (p - 1)) and max(ofb) == pytest.approx(6 * (p - 1))


def test_zbv_needs_two_stages_per_rank_and_the_v():
    with pytest.raises(ValueError, match="ZB-V places 2 stages per rank, not 3"):
        build("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match="the V placement holds 2 stages per rank"):
        stage_ranks(2, 6, "v")
    # The loop placement's ranks refuse the V's programs (rank 0 runs stage 3 there).
    with pytest.raises(ScheduleError, match="stage 3 runs on rank 1, not 0"):
        check(build("zbv", 2, 4, 2), 4, 4, rendezvous=False)
    # The turn on rank p-1 is a hand-over: no rendezvous wait for its own receive.
    check(build("zbv", 1, 3, 2), 3, 2, ranks=[0, 0])


# --- DualPipeV: ZB-V's V in DeepSeek's order ------------------------------------------

@pytest.mark.parametrize("p", (1, 2, 3, 4, 5, 6))
def test_dualpipev_is_valid_and_complete(p):
    ranks = stage_ranks(p, 2 * p, "v")
    for m in (*range(2 * p, 3 * p + 3), 24):
        sched = build("dualpipev", p, m, 2)
        check(sched, m, 2 * p, rendezvous=False, ranks=ranks)
        for r, prog in enumerate(sched):
            comp = compute_only(prog)
            for s in (r, 2 * p - 1 - r):
                for kind in "FB":
                    assert sorted(a.mb for a in comp if a.stage == s and a.kind == kind) == \
                        list(range(m))
            # Split: chunk 1's first p-1-r backwards (warm-up), the last pairs' from the
            # middle on (r+1 of them) and chunk 0's last p-1-r; every W after its B.
            ws = [a for a in comp if a.kind == "W"]
            assert len(ws) == 2 * (p - 1 - r) + r + 1, (p, m, r)
            for w in ws:
                assert comp.index(Action(w.stage, "B", w.mb)) < comp.index(w)
            # One more stage micro-batch in flight than ZB-V's 2p.
            assert in_flight(prog) == 2 * p + 1


@pytest.mark.parametrize("p", (1, 2, 3, 4, 5))
@pytest.mark.parametrize("m_over", (0, 1, 3, 8))
def test_dualpipev_never_idles_more_than_zbv(p, m_over):
    m = 2 * p + m_over
    for costs in ((1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1)):
        dual = idle_time(simulate(build("dualpipev", p, m, 2), unit_costs(*costs)))
        vee = idle_time(simulate(build("zbv", p, m, 2), unit_costs(*costs)))
        assert max(dual) <= max(vee) + 1e-9, (costs, dual, vee)
        if costs == (1, 1, 1):  # equal times: the lead alone, as ZB-V
            assert max(dual) == pytest.approx(p - 1)
    # A longer B: strictly less (p > 1), the steady state's full backwards paired
    # against the other arm's forwards.
    if p > 1:
        assert max(idle_time(simulate(build("dualpipev", p, m, 2), unit_costs(1, 2, 1)))) < \
            max(idle_time(simulate(build("zbv", p, m, 2), unit_costs(1, 2, 1))))


def test_dualpipev_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="DualPipeV places 2 stages per rank in a V, not 3"):
        build("dualpipev", 2, 8, 3)
    with pytest.raises(ValueError, match=r"at least one micro-batch per stage, 2p = 6, not "
                                         r"n_microbatches=5: give more micro-batches, or use zbv"):
        build("dualpipev", 3, 5, 2)


# --- Looped BFS: the interleaved placement, breadth first ------------------------------

@pytest.mark.parametrize("p", (1, 2, 3, 4, 5))
@pytest.mark.parametrize("v", (1, 2, 3, 4))
def test_looped_bfs_is_valid_and_runs_each_stage_back_to_back(p, v):
    ranks = stage_ranks(p, p * v)
    for m in (1, 2, 3, 5, 8):
        sched = build("looped-bfs", p, m, v)
        check(sched, m, p * v, rendezvous=False, ranks=ranks)
        for r, prog in enumerate(sched):
            comp = compute_only(prog)
            stages = list(range(r, p * v, p))
            assert comp == [Action(s, "F", k) for s in stages for k in range(m)] + \
                [Action(s, "B", k) for s in reversed(stages) for k in reversed(range(m))]
            assert in_flight(prog) == v * m  # every micro-batch on every stage at the turn
    if v == 1:  # one stage per rank: GPipe's idle (its backwards in the other order)
        for m in (1, 4, 8):
            assert idle_time(simulate(build("looped-bfs", p, m, 1))) == pytest.approx(
                idle_time(simulate(build("gpipe", p, m))))


def test_torchs_schedule_names_give_mpirings_classes():
    from mpiring.parallel import pipeline as pl

    # torch.distributed.pipelining.get_schedule_class's names, in any case.
    for name, cls in (("1F1B", pl.Schedule1F1B), ("gpipe", pl.ScheduleGPipe),
                      ("Interleaved1F1B", pl.ScheduleInterleaved1F1B),
                      ("LOOPEDBFS", pl.ScheduleLoopedBFS),
                      ("InterleavedZeroBubble", pl.ScheduleInterleavedZeroBubble),
                      ("ZBVZeroBubble", pl.ScheduleZBVZeroBubble), ("DualPipeV", pl.ScheduleDualPipeV),
                      ("PipelineScheduleMulti", pl.PipelineSchedule),
                      ("ZeroBubble", pl.ScheduleZeroBubble), ("pipedream", pl.SchedulePipeDream)):
        assert pl.get_schedule_class(name) is cls, name
    # Each class builds its own generator's programs, by the name it carries.
    for cls in set(pl.SCHEDULE_CLASSES.values()) - {pl.PipelineSchedule, pl.SchedulePipeDream}:
        assert cls.name in (*GENERATORS, *MULTI), cls
    # ... and mpiring's own, as train --schedule spells them.
    for name, cls in (("zbv", pl.ScheduleZBVZeroBubble), ("looped-bfs", pl.ScheduleLoopedBFS),
                      ("interleaved-zb", pl.ScheduleInterleavedZeroBubble),
                      ("zb", pl.ScheduleZeroBubble), ("dualpipev", pl.ScheduleDualPipeV)):
        assert pl.get_schedule_class(name) is cls, name
    with pytest.raises(ValueError, match=r"unknown schedule name 'ZB1P': use one of 1F1B, "
                                         r"Interleaved1F1B, GPipe, LoopedBFS, .*, DualPipeV "
                                         r"\(torch's\), ZeroBubble, PipeDream, or 1f1b, "
                                         r".*dualpipev"):
        pl.get_schedule_class("ZB1P")


def test_torchs_overlapped_pairs_read_as_their_two_actions(tmp_path):
    from mpiring.parallel.pipeline.actions import parse_cell

    assert parse_cell("(0F3;1B2)OVERLAP_F_B") == [Action(0, "F", 3), Action(1, "B", 2)]
    assert parse_cell(" 1I4 ") == [Action(1, "B", 4)]
    with pytest.raises(ValueError, match="cannot read 'X' as an action"):
        parse_cell("(0F3;X)OVERLAP_F_B")
    # A compute-only dump in torch's form, the pairs as torch writes them: DualPipeV's
    # programs once read (and lowered), and valid.
    progs = build("dualpipev", 2, 4, 2)
    rows = []
    for prog in progs:
        comp, cells = compute_only(prog), []
        i = 0
        while i < len(comp):
            a = comp[i]
            nxt = comp[i + 1] if i + 1 < len(comp) else None
            if a.kind == "F" and nxt is not None and nxt.kind == "B" and nxt.stage != a.stage:
                cells.append(f"({a};{nxt})OVERLAP_F_B")
                i += 2
            else:
                cells.append(str(a))
                i += 1
        rows.append(",".join(cells))
    assert any("OVERLAP_F_B" in row for row in rows)
    path = tmp_path / "dualpipev.csv"
    path.write_text("\n".join(rows) + "\n")
    assert load_csv(path) == progs
    check(load_csv(path), 4, 4, rendezvous=False, ranks=stage_ranks(2, 4, "v"))


def _torchs(cls_name: str, p: int, m: int, r: int, v: int) -> list[Action]:
    """Rank r's compute actions as torch's own schedule class generates them (its
    program generator, run on a stand-in for the schedule: no stages, no processes);
    an overlapped pair as its forward, then its backward, as mpiring runs it."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(pipelining, cls_name, None)
    if cls is None:
        pytest.skip(f"this torch has no {cls_name}")

    class Stand:
        pp_group_size, _n_microbatches, _stages = p, m, [None] * v
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B",
             "BACKWARD_WEIGHT": "W"}
    out = []
    for a in cls._calculate_single_rank_operations(Stand(), r):
        for x in (a.sub_actions or (a,)) if a is not None else ():
            out.append(Action(x.stage_index, kinds[x.computation_type.name], x.microbatch_index))
    return out


@pytest.mark.parametrize("p", (1, 2, 3, 4, 5))
def test_dualpipev_and_looped_bfs_run_torchs_order(p):
    # The reference: torch.distributed.pipelining's ScheduleDualPipeV (DeepSeek's order)
    # and ScheduleLoopedBFS, action for action, W's (the split backwards) included.
    for m in range(2 * p, 3 * p + 3):
        for r, prog in enumerate(build("dualpipev", p, m, 2)):
            assert compute_only(prog) == _torchs("ScheduleDualPipeV", p, m, r, 2), (p, m, r)
    for v in (1, 2, 3):
        for m in (1, 3, 4):
            for r, prog in enumerate(build("looped-bfs", p, m, v)):
                assert compute_only(prog) == _torchs("ScheduleLoopedBFS", p, m, r, v), (p, m, v)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2),
                                    ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2),
                                    ("looped-bfs", 3)])
def test_each_stage_reduces_once_in_a_whole_b_or_its_last_w(name, v):
    # Data parallelism: a stage's replicas reduce in one action, the last that writes
    # its gradients; a B chosen for it is never split (no W after it).
    from mpiring.parallel.pipeline.runtime import reduction_points

    for p in (1, 2, 3, 4):
        for m in range(2 * p if name == "dualpipev" else 1, 2 * p + 3):
            for prog in build(name, p, m, v):
                comp = compute_only(prog)
                for s in {a.stage for a in comp}:
                    in_b, in_w = reduction_points(prog, s)
                    assert in_b != in_w, (name, p, m, s)
                    if in_b:
                        last = [a for a in comp if a.stage == s and a.kind == "B"][-1]
                        assert Action(s, "W", last.mb) not in comp, (name, p, m, s)
                    # The split schedules reduce in W; DualPipeV's head on rank 0 in its
                    # last (whole) B; every other, in B.
                    want_w = name in ("zb", "interleaved-zb", "zbv") or (
                        name == "dualpipev" and s != 2 * p - 1)
                    assert in_w == want_w, (name, p, m, s)
