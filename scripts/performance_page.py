"""Write docs/performance.md (and its pictures) from one run of scripts/performance.sh.

    python scripts/performance_page.py machine OUT/machine.json   # before and after the run
    python scripts/performance_page.py page OUT --page docs/performance.md --pictures docs

``machine`` records the date, the machine and its load (called at the start,
and again with ``--end`` at the end). ``page`` reads the JSON and text the
benches left in OUT and writes the page: every table and picture comes from
that one run, so the page is regenerated, never edited by hand. Pictures need
matplotlib; without it the page says so and keeps its tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

KIB, MIB = 1 << 10, 1 << 20
ALLREDUCE = ("ring", "ring-seg", "recursive-doubling", "halving-doubling", "auto", "gloo")
BCAST = ("ring", "pipelined")


# --- the machine ---------------------------------------------------------------------
def _first(path: str, key: str) -> str:
    try:
        for line in open(path):
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine(path: str, end: bool, commit: str = "unknown") -> None:
    """Record (or, with ``end``, complete) the run's date, machine and load."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]
    if end:
        info = json.loads(Path(path).read_text())
        info.update(end=now, load_end=load)
    else:
        import numpy
        import torch

        try:
            from mpi4py import MPI
            mpi = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        except Exception as exc:  # noqa: BLE001 - the page says what it could not learn
            mpi = f"unknown ({exc})"
        from mpiring.runtime.pages import thp_mode

        mem = _first("/proc/meminfo", "MemTotal")
        info = {"start": now, "load_start": load, "cpu": _first("/proc/cpuinfo", "model name"),
                "cores": len(os.sched_getaffinity(0)), "memory_gib":
                    round(int(mem.split()[0]) / 2**20, 1) if mem != "unknown" else None,
                "system": f"{platform.system()} {platform.release()} {platform.machine()}",
                "python": platform.python_version(), "numpy": numpy.__version__,
                "torch": torch.__version__, "mpi": mpi, "thp": thp_mode(), "commit": commit}
    Path(path).write_text(json.dumps(info, indent=1) + "\n")


# --- formatting ------------------------------------------------------------------------
def size_label(n: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def ratio(row: dict | None) -> str:
    if row is None or row.get("vs_native") is None:
        return "-"
    q1, q3 = row.get("vs_native_q1"), row.get("vs_native_q3")
    iqr = f" ({q1:.2f}-{q3:.2f})" if q1 is not None and q3 is not None else ""
    return f"{row['vs_native']:.2f}{iqr}"


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "-"


def load_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def code(text: str) -> list[str]:
    return ["```", text.rstrip(), "```", ""]


# --- sections ---------------------------------------------------------------------------
def collective_section(rows: list[dict], k: int, pictures: dict[str, str]) -> list[str]:
    from mpiring.comm.autotune import builtin

    table = builtin("mpi", k, [k])
    out = [f"### {k} ranks", ""]
    if f"busbw-{k}" in pictures:
        out += [f"![busbw against size, {k} ranks]({pictures[f'busbw-{k}']})", ""]
    ar = [r for r in rows if r["collective"] == "all_reduce"]
    algos = [a for a in ALLREDUCE if any(r["algo"] == a for r in ar)]
    out += ["| size | MPI_Allreduce (us) | " + " | ".join(algos) + " | auto ran |",
            "|---:|---:|" + "---:|" * len(algos) + "---|"]
    for size in sorted({r["bytes"] for r in ar}):
        at = {r["algo"]: r for r in ar if r["bytes"] == size}
        native = at.get("native")
        t = f"{native['time_us']:.1f}" if native else "-"
        cells = [ratio(at.get(a)) for a in algos]
        out.append(f"| {size_label(size)} | {t} | " + " | ".join(cells)
                   + f" | {table.choose('all_reduce', size, native_ok=False)} |")
    out.append("")
    big = [r for r in ar if r["bytes"] >= MIB and r.get("vs_native") is not None]
    small = [r for r in ar if r["bytes"] < MIB and r.get("vs_native") is not None]
    notes = []
    for a in ("ring", "ring-seg"):
        v = [r["vs_native"] for r in big if r["algo"] == a]
        if v:
            notes.append(f"`{a}` {spread(v)} native from 1 MiB up")
    v = [r["vs_native"] for r in small if r["algo"] == "auto"]
    if v:
        notes.append(f"`auto` {spread(v)} below 1 MiB")
    errs = [r["model_err"] for r in big if r["algo"] == "ring" and r.get("model_err") is not None]
    if errs:
        notes.append(f"the alpha-beta model's error for `ring` {min(errs):+.0%} to "
                     f"{max(errs):+.0%} from 1 MiB up")
    bound = next((r["bound_busbw"] for r in ar if r.get("bound_busbw")), None)
    fracs = [r["bound_frac"] for r in ar if r["algo"] == "ring-seg" and r.get("bound_frac")]
    if bound and fracs:
        notes.append(f"`ring-seg` at up to {max(fracs):.0%} of the memory-bandwidth bound "
                     f"({bound:.1f} GB/s)")
    wrong = sum(r["wrong"] for r in rows)
    notes.append(f"`#wrong` {wrong} in all")
    out += ["In this run: " + "; ".join(notes) + ".", ""]
    bc = [r for r in rows if r["collective"] == "broadcast"]
    if bc:
        out += [f"Broadcast on {k} ranks, root 0:", "",
                "| size | MPI_Bcast (us) | " + " | ".join(a for a in BCAST) + " | S |",
                "|---:|---:|" + "---:|" * len(BCAST) + "---:|"]
        for size in sorted({r["bytes"] for r in bc}):
            at = {r["algo"]: r for r in bc if r["bytes"] == size}
            native = at.get("native")
            chunks = (at.get("pipelined") or {}).get("chunks")
            out.append(f"| {size_label(size)} | {native['time_us']:.1f} | "
                       + " | ".join(ratio(at.get(a)) for a in BCAST) + f" | {chunks or '-'} |"
                       if native else f"| {size_label(size)} | - |")
        out.append("")
    return out


def zero_section(out_dir: Path) -> list[str]:
    out = []
    for path in sorted(out_dir.glob("zero-steps-*.txt")):
        line = path.read_text().strip().splitlines()[-1] if path.read_text().strip() else ""
        parts = re.findall(r"(\w+) (\d+) ms \(([\d.]+)x\)", line)
        k = path.stem.rsplit("-", 1)[-1]
        if parts:
            out.append(f"* {k} ranks, steps alternated in one process: "
                       + ", ".join(f"{n} {ms} ms ({x}x)" for n, ms, x in parts))
    if out:
        out.append("")
    mem = out_dir / "zero-memory.jsonl"
    if mem.exists():
        rows = [json.loads(line) for line in mem.read_text().splitlines() if line.strip()]
        out += ["| ranks | optimizer | AdamW state per rank (MiB) | peak RSS (MiB) | growth (MiB) "
                "| sent per step (MiB) |", "|---:|---|---:|---:|---:|---:|"]
        out += [f"| {r['ranks']} | {r['optimizer']} | {r['state_mib_per_rank']:.1f} | "
                f"{r['peak_rss_mib']:.0f} | {r['rss_growth_mib']:.0f} | "
                f"{r['sent_mib_per_step']:.1f} |" for r in rows]
        out.append("")
    return out


def hooks_section(data: dict) -> list[str]:
    s, results = data["settings"], data["results"]
    base = next((r for r in results if r["hook"] == "none"), results[0])
    out = [f"{s['ranks']} ranks, `{s['preset']}` GPT, {s['steps']} steps per hook, batch "
           f"{s['ranks']} x {s['batch_size']}, top-k ratio {s['topk_ratio']}, PowerSGD rank "
           f"{s['powersgd_rank']}, hooks from step {s['hook_start']}; the hooks' steps "
           "alternated in one process.", "",
           "| hook | sent per step (MiB) | fewer bytes | step time | validation loss at the end |",
           "|---|---:|---:|---:|---:|"]
    for r in results:
        sent = r["sent_bytes_per_step"]
        fewer = f"{base['sent_bytes_per_step'] / sent:.0f}x" if sent else "-"
        out.append(f"| {r['hook']} | {sent / MIB:.2f} | {fewer} | "
                   f"{r['step_s'] / base['step_s']:.2f}x | {r['curve'][-1][1]:.3f} |")
    return out + [""]


# --- the page ---------------------------------------------------------------------------
def draw(out_dir: Path, pictures_dir: Path, ranks: list[int]) -> tuple[dict[str, str], str]:
    """Draw the pictures; returns {name: link} and a note (empty, or why there are none)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return {}, "No pictures: matplotlib is not installed (`pip install -e \".[plot]\"`)."
    from mpiring.tools.bench.ddp import plot_ddp
    from mpiring.tools.bench.ps import plot_ps
    from mpiring.tools.bench.report import plot_busbw

    made = {}
    for k in ranks:
        rows = (load_json(out_dir / f"bench-{k}.json") or []) + \
            (load_json(out_dir / f"bcast-{k}.json") or [])
        if rows:
            plot_busbw(rows, str(pictures_dir / f"busbw-{k}.png"), title=f"{k} ranks")
            made[f"busbw-{k}"] = f"busbw-{k}.png"
    rows = load_json(out_dir / f"ddp-{max(ranks)}.json")
    if rows:
        plot_ddp(rows, str(pictures_dir / "ddp.png"), title=f"bench-ddp, {max(ranks)} ranks")
        made["ddp"] = "ddp.png"
    rows = load_json(out_dir / "ps.json")
    if rows:
        plot_ps(rows, str(pictures_dir / "ps.png"))
        made["ps"] = "ps.png"
    if (pictures_dir / "timeline.png").exists() and (out_dir / "trace").is_dir():
        made["timeline"] = "timeline.png"
    return made, ""


def page(out_dir: Path, page_path: Path, pictures_dir: Path) -> None:
    from mpiring.tools.bench.ddp import format_ddp_table
    from mpiring.tools.bench.pipeline import format_chunks_table
    from mpiring.tools.bench.ps import format_ps_table

    m = json.loads((out_dir / "machine.json").read_text())
    commands = (out_dir / "commands.txt").read_text().strip()
    ranks = sorted(int(p.stem.split("-")[1]) for p in out_dir.glob("bench-*.json"))
    pictures, why = draw(out_dir, pictures_dir, ranks)
    top = max(ranks)
    shared = top > m["cores"] or m["load_start"] > 0.5
    lines = ["# Performance: one run", "",
             "<!-- Written by scripts/performance.sh (scripts/performance_page.py): "
             "rerun it, do not edit. -->", "",
             f"Measured {m['start']} to {m['end']}, commit {m.get('commit', 'unknown')}, on {m['system']}, {m['cores']} cores "
             f"({m['cpu']}), {m['memory_gib']} GiB; Python {m['python']}, NumPy {m['numpy']}, "
             f"torch {m['torch']}, {m['mpi']}; transparent huge pages: {m['thp']}. "
             f"1-minute load average {m['load_start']:.1f} at the start, {m['load_end']:.1f} "
             "at the end.", ""]
    if shared:
        lines += [f"**The cores were shared**: up to {top} ranks on {m['cores']} cores"
                  + (", and other work ran on the machine during the run" if
                     m["load_start"] > 0.5 else "")
                  + ". Absolute times on such a machine move from run to run; the ratios of "
                    "things measured in turns, side by side in one run, hold better, and each "
                    "ratio's IQR (the middle half of its per-iteration ratios) shows its "
                    "spread. An IQR that spans 1.00 does not tell the two apart.", ""]
    if why:
        lines += [why, ""]
    lines += ["Regenerate it on your machine with `scripts/performance.sh`; the commands it "
              "ran:", ""] + code(commands)
    lines += ["## Collectives against the MPI library's own", "",
              "Each entry is busbw as a multiple of the library's at the same size (above 1: "
              "faster), then the IQR of the paired per-iteration ratio; float32, sum. "
              "`auto ran` is what the built-in table picks at that size (the run used no "
              "tuned table). Broadcast: `pipelined` with the S the Communicator chose.", ""]
    for k in ranks:
        rows = load_json(out_dir / f"bench-{k}.json") + (load_json(out_dir / f"bcast-{k}.json") or [])
        lines += collective_section(rows, k, pictures)
    chunks = load_json(out_dir / "chunks.json")
    if chunks:
        lines += ["## Pipelined Broadcast: S against the model's S*", ""]
        lines += code(format_chunks_table(chunks))
    ps = load_json(out_dir / "ps.json")
    if ps:
        lines += ["## Parameter server against the ring AllReduce", ""]
        if "ps" in pictures:
            lines += [f"![parameter server vs ring: traffic and time against K]({pictures['ps']})", ""]
        lines += code(format_ps_table(ps))
    ddp = [(k, load_json(out_dir / f"ddp-{k}.json")) for k in ranks]
    if any(rows for _, rows in ddp):
        lines += ["## DDP: where a training step's time goes", ""]
        if "ddp" in pictures:
            lines += [f"![DDP step time by part, per mode, {top} ranks]({pictures['ddp']})", ""]
        for _k, rows in ddp:
            if rows:
                lines += code(format_ddp_table(rows))
    zero = zero_section(out_dir)
    if zero:
        lines += ["## ZeRO against DDP + AdamW", ""] + zero
    hooks = load_json(out_dir / "hooks.json")
    if hooks:
        lines += ["## Comm hooks", ""] + hooks_section(hooks)
    costs = sorted(out_dir.glob("check-cost-*.txt"))
    if costs:
        lines += ["## What the argument check and the watchdog cost", ""]
        for path in costs:
            lines += code(path.read_text())
    if "timeline" in pictures:
        lines += ["## A traced ring AllReduce", "",
                  "16 MiB on 4 ranks, `algo=\"ring\"`: three ReduceScatter steps, then three "
                  "AllGather steps on every rank; the gaps between steps are the Python work "
                  "between MPI calls.", "",
                  f"![timeline of a traced ring AllReduce]({pictures['timeline']})", ""]
    page_path.write_text("\n".join(lines).rstrip() + "\n")
    print(f"performance_page: wrote {page_path}" + (f" and {len(pictures)} picture(s)"
                                                    if pictures else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("machine", help="record the date, machine and load")
    m.add_argument("file")
    m.add_argument("--end", action="store_true", help="add the end time and load")
    m.add_argument("--commit", default="unknown", help="the code measured (git commit)")
    g = sub.add_parser("page", help="write the page from a run's output folder")
    g.add_argument("out", help="the folder scripts/performance.sh wrote")
    g.add_argument("--page", default="docs/performance.md")
    g.add_argument("--pictures", default="docs", help="folder for the PNGs (the page's folder)")
    args = p.parse_args(argv)
    if args.what == "machine":
        machine(args.file, args.end, args.commit)
    else:
        page(Path(args.out), Path(args.page), Path(args.pictures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
