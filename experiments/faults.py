"""The fault tests, run and reported: every fault injected into a search, a trace cache or a
policy folder, and what it cost (finished trials lost; the target is zero).

    python experiments/faults.py [--out experiments/results/faults.md] [-k EXPR]

Runs ``tests/search/test_faults.py`` (real ``autoscale search`` workers on SQLite and a private
PostgreSQL server: SIGKILL mid-trial, a server crash, damaged caches),
``tests/scalers/test_publish.py`` (exports killed half-way and racing for one name, as threads
and as processes) and ``tests/search/test_trace_cache.py`` (each kind of damaged trace) with
pytest; each test appends its figures to a JSON-lines file, written here as a table. Tests that
fail are listed; their faults are not counted as survived.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/search/test_faults.py",
    "tests/scalers/test_publish.py",
    "tests/search/test_trace_cache.py",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "faults.md"))
    p.add_argument("-k", dest="select", help="pytest -k expression (a subset of the tests)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="autoscale-faults-") as tmp:
        records = Path(tmp) / "faults.jsonl"
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
        cmd += ["--junitxml", str(junit)] + (["-k", args.select] if args.select else [])
        env = dict(os.environ, AUTOSCALE_FAULTS_REPORT=str(records), OMP_NUM_THREADS="1")
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env)
        wall = time.monotonic() - t0
        rows = (
            [json.loads(line) for line in records.read_text().splitlines()]
            if records.exists()
            else []
        )
        outcome = _junit(junit)
    text = _render(
        rows, outcome, wall, " ".join(["python experiments/faults.py", *(argv or sys.argv[1:])])
    )
    Path(args.out).write_text(text)
    print(text)
    return proc.returncode


def _junit(path: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped (with the skip reason)."""
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {}
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        if case.find("failure") is not None or case.find("error") is not None:
            out[name] = "failed"
        elif case.find("skipped") is not None:
            out[name] = "skipped: " + (case.find("skipped").get("message") or "")
        else:
            out[name] = "passed"
    return out


def _render(rows: list[dict], outcome: dict[str, str], wall: float, command: str) -> str:
    passed = [r for r in rows if outcome.get(r["test"], "passed") == "passed"]
    injected = sum(r["injected"] for r in passed)
    finished = sum(r["finished_before"] for r in passed)
    lost = sum(r["lost"] for r in passed)
    searches = sum(r["injected"] for r in passed if r["finished_before"])
    lines = [
        "# Faults injected and what they cost",
        "",
        f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M')} "
        f"({platform.node()}, {os.cpu_count()} CPUs, load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end; {wall / 60:.1f} min).",
        "",
        f"**{injected} faults injected in {len(passed)} passing tests. Into running searches: "
        f"{searches} faults, when {finished} trials had finished in their storages; "
        f"{lost} of those trials were lost.**",
        "",
        "| fault | where | injected | trials finished before | lost | what happened |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        state = outcome.get(r["test"], "passed")
        what = r["outcome"] if state == "passed" else f"TEST {state.upper()}: {r['outcome']}"
        before = r["finished_before"] if r["finished_before"] else "-"
        lines.append(
            f"| {r['fault']} | {r['storage']} | {r['injected']} | {before} | {r['lost']} | {what} |"
        )
    reported = {r["test"] for r in rows}
    other = {k: v for k, v in outcome.items() if k not in reported and v != "passed"}
    if other:
        lines += ["", "Tests that did not pass or ran no fault:", ""]
        lines += [f"- `{k}`: {v}" for k, v in sorted(other.items())]
    details = [r for r in rows if r.get("details")]
    if details:
        lines += ["", "## Details", ""]
        for r in details:
            lines.append(f"- `{r['test']}`: " + json.dumps(r["details"], default=str))
    lines += [
        "",
        "A search fault counts a trial as lost when a trial finished (complete or pruned) in the",
        "storage before the fault is missing afterwards or holds another state, value or parameters.",
        "Every wait in these tests is for an event (a trial state in the storage, a process stopped",
        "or gone, a file appearing), never a sleep of a guessed length.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
