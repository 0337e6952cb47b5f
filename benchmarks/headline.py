"""The headline figures of BENCHMARKS.md, measured in one run on one GPU, into one JSON file
rewritten after every step (a run stopped at its time limit keeps every step that finished),
each entry with its figures, its command, the card (``torch.cuda.get_device_name()``) and the
UTC date; then printed as the Markdown table BENCHMARKS.md opens with.

    python3 benchmarks/headline.py [--out headline.json] [--only A,B | --skip A,B] [--with-8b]
        [--artifact-1b DIR] [--artifact-1b-int4 DIR] [--artifact-8b DIR] [--work DIR]
        [--budget SECONDS]
    python3 benchmarks/headline.py --table headline.json

The artifacts are built on this machine unless given (``python3 -m trtc build
configs/llama-1b-random.yaml``, ``configs/llama-1b-random-int4.yaml``; the 1.1B fp16 one then
``trtc tune``d; with ``--with-8b``, ``trtc checkpoint llama-3-8b`` built in fp16 with the 1.1B
config's limits, then tuned), the two 1.1B builds side by side while the copy bandwidth is
measured. Every step has a time limit and the whole run ``--budget`` seconds: a step that would
start with less than 30 s left is recorded as skipped. Besides the JSON: every command's output
in ``OUT.log`` (``OUT`` the results file without ``.json``), the server's in
``OUT-server.log``. The 8B steps (checkpoint, build, tune: about 5 minutes) do not fit one
10-minute call beside the rest: run them in a call of their own, ``--with-8b --only
mixed_8b,tpot_8b,speculative_8b``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from headline_artifacts import build_beside, prepared
from headline_measurements import EIGHT_B, MEASUREMENTS, card_name
from headline_results import ResultsFile, table, utc_now
from headline_runs import FULL, SMOKE, Headline, Options, Runner

BUDGET_S = 520.0  # a 10-minute call, less the wheels' install and the last kill's grace
WORK = "/tmp/trtc-headline"


def measurement_names() -> dict[str, str]:
    """Each measurement's name and what it measures, in the order they run."""
    return {name: m.about for name, m in MEASUREMENTS.items()}


def plan(only: list[str], skip: list[str], with_8b: bool) -> list[str]:
    """The measurements to run, in order: all of them (the 8B ones with ``with_8b`` only), or
    those ``only`` names, less those ``skip`` names."""
    names = list(measurement_names())
    unknown = sorted((set(only) | set(skip)) - set(names))
    if unknown:
        known = ", ".join(names)
        raise ValueError(f"unknown measurement {', '.join(unknown)}; choose from {known}")
    if set(only) & set(EIGHT_B) and not with_8b:
        raise ValueError(f"{', '.join(sorted(set(only) & set(EIGHT_B)))}: give --with-8b")
    names = [n for n in names if with_8b or n not in EIGHT_B]
    return [n for n in names if (not only or n in only) and n not in skip]


def names_list(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    about = "\n".join(f"  {n:16s} {a}" for n, a in measurement_names().items())
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"measurements, in the order they run (the 8B ones with --with-8b):\n{about}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("headline.json"), help="the results file")
    p.add_argument("--table", type=Path, help="print the Markdown table of this results file")
    p.add_argument("--only", type=names_list, default=[], help="run these measurements only")
    p.add_argument("--skip", type=names_list, default=[], help="run all but these")
    p.add_argument("--with-8b", action="store_true", help="also the Llama-3-8B geometry")
    for key in ("1b", "1b-int4", "8b"):
        p.add_argument(f"--artifact-{key}", type=Path, help="measure this artifact (no build)")
    p.add_argument("--work", type=Path, default=Path(WORK), help="builds and checkpoints here")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny request sets: checks the script end to end (on a CPU too, with small "
        "artifacts given); its figures mean nothing",
    )
    args = p.parse_args(argv)
    if args.only and args.skip:
        p.error("--only and --skip: give one")
    try:
        args.plan = plan(args.only, args.skip, args.with_8b)
    except ValueError as e:
        p.error(str(e))
    return args


def options_of(args: argparse.Namespace) -> Options:
    """The run's `headline_runs.Options`: every path absolute (the commands start in the work
    folder)."""
    out = args.out.resolve()
    stem = out.with_suffix("")
    given = {"1b": args.artifact_1b, "1b_int4": args.artifact_1b_int4, "8b": args.artifact_8b}
    return Options(
        out=out,
        log=stem.with_name(stem.name + ".log"),
        server_log=stem.with_name(stem.name + "-server.log"),
        work=args.work.resolve(),
        given={key: path.resolve() for key, path in given.items() if path is not None},
        workloads=SMOKE if args.smoke else FULL,
    )


def measure(args: argparse.Namespace) -> int:
    """Run the plan; the results in ``args.out``, the table printed at the end."""
    options = options_of(args)
    for folder in (options.work, options.out.parent):
        folder.mkdir(parents=True, exist_ok=True)
    options.log.write_text("")
    runner = Runner(time.monotonic() + args.budget)
    # The commands start in the work folder, not in the repository's root, whose trtc/ folder
    # would shadow the installed package for `python3 -m trtc`.
    os.chdir(options.work)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        card = card_name(runner, options)
        header = {"script": "benchmarks/headline.py", "argv": sys.argv[1:], "card": card}
        results = ResultsFile(options.out, {**header, "started": utc_now()})
        run_plan(Headline(results, runner, card, options), args.plan)
    finally:
        runner.kill_all()
    print("\n" + table(json.loads(options.out.read_text())), flush=True)
    return 0


def run_plan(h: Headline, names: list[str]) -> None:
    """The copy bandwidth while the 1.1B builds run side by side, then each measurement on its
    artifact (prepared on first use; skipped, and said so, where it could not be)."""
    keys = {MEASUREMENTS[n].key for n in names}
    builds = build_beside(h, [k for k in ("1b", "1b_int4") if k in keys])
    if "copy_bandwidth" in names:
        MEASUREMENTS["copy_bandwidth"].run(h, None, "copy_bandwidth")
    for thread in builds:
        thread.join()
    for name in names:
        m = MEASUREMENTS[name]
        if m.key is None:
            continue
        artifact = prepared(h, m.key)
        if artifact is None:
            h.skip(name, m.about, f"its artifact ({m.key}) could not be prepared: see the builds")
        else:
            m.run(h, artifact, name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
