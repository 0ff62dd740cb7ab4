"""The CLI turns bad values into one-line errors with the accepted form, never a traceback."""

from __future__ import annotations

import pytest

from mpiring.cli import build_parser, parse_size


@pytest.mark.parametrize("text,nbytes", [("4096", 4096), ("4K", 4096), ("16M", 16 << 20),
                                         ("1.5G", 3 << 29), ("64MiB", 64 << 20), ("2kb", 2048),
                                         (" 8 ", 8), ("0", 0), (1024, 1024)])
def test_parse_size_accepts_the_documented_forms(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["12Q", "inf", "nan", "-1", "-4K", "", "M", "1.3", "0x10", -5])
def test_parse_size_refuses_with_the_accepted_form(text):
    with pytest.raises(ValueError, match=r"size .*(K, M or G|negative)"):
        parse_size(text)


CASES = [
    (["allreduce", "--size", "12Q"], r"argument --size: size '12Q': use a number of bytes with "
                                     r"an optional binary suffix K, M or G \(e\.g\. 4096, 4K"),
    (["allreduce", "--size", "inf"], r"argument --size: size 'inf': use a finite, non-negative"),
    (["allreduce", "--size", "-1"], r"argument --size: size '-1': use a finite, non-negative"),
    (["allreduce", "--size", "0"], r"argument --size: size '0': give at least 1 byte"),
    (["allreduce", "--algo", "nonsense"], r"argument --algo: invalid choice: 'nonsense' "
                                          r"\(choose from 'auto', 'ring'"),
    (["allreduce", "--iters", "0"], r"argument --iters: '0': use a whole number >= 1"),
    (["bench", "-b", "12Q"], r"argument -b/--minbytes: size '12Q': use a number of bytes"),
    (["bench", "-e", "1e400"], r"argument -e/--maxbytes: size '1e400': use a finite"),
    (["bench", "-f", "1"], r"argument -f/--stepfactor: '1': use a number above 1"),
    (["bench", "-n", "x"], r"argument -n/--iters: 'x': use a whole number >= 1"),
    (["train", "--seq-len", "0"], r"argument --seq-len: '0': use a whole number >= 1"),
    (["train", "--steps", "-3"], r"argument --steps: '-3': use a whole number >= 1"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_value_is_one_usage_error_line(argv, message, capsys):
    import re

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert re.search(message, last), err
    assert last.startswith(f"python -m mpiring {argv[0]}: error: ") and "Traceback" not in err


@pytest.mark.deadline(90)
def test_a_bad_value_found_while_running_is_one_line_too(rank0_subprocess):
    # tune reads its sizes after MPI starts (check-cost's are parsed with the flags now)
    result = rank0_subprocess(1, ["-m", "mpiring", "tune", "--max-size", "12Q"], timeout=60)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 2 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == (
        "python -m mpiring tune: error: ValueError: size '12Q': use a number of bytes "
        "with an optional binary suffix K, M or G (e.g. 4096, 4K, 16M, 1.5G)"), out


@pytest.mark.deadline(120)
def test_under_mpiexec_errors_every_rank_shares_are_printed_once(rank0_subprocess):
    # Four copies of argparse's usage, and init's refused setting printed by each
    # rank and ended with MPI_Abort (exit 1): both are one message, exit 2, now.
    result = rank0_subprocess(2, ["-m", "mpiring", "allreduce", "--no-such-flag"], timeout=60)
    if result is not None:
        rc, out, _ = result
        assert rc == 2 and out.count("unrecognized arguments: --no-such-flag") == 1, out
        assert out.count("usage:") == 1, out
    refused = ("import os, sys; os.environ['MPIRING_CHECK'] = 'maybe'; "
               "from mpiring.cli import main; sys.exit(main(['allreduce']))")
    result = rank0_subprocess(2, ["-c", refused], timeout=60)
    if result is not None:
        rc, out, _ = result
        assert rc == 2 and "Abort" not in out and "[r" not in out, out
        assert out.strip().splitlines() == [
            "python -m mpiring allreduce: mpiring.init: MPIRING_CHECK='maybe': use 1 or 0 "
            "(true/false, yes/no, on/off)"], out
    # A setting that a command refuses before MPI starts (each rank finds it alike).
    result = rank0_subprocess(2, ["-m", "mpiring", "train", "--pp", "2", "--vpp", "2"],
                              timeout=60)
    if result is not None:
        rc, out, _ = result
        assert rc == 2 and out.count("mpiring train: vpp=2 with --schedule 1f1b") == 1, out
