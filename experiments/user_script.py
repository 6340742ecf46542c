"""A user's own script under ``autoscale wrap``, the way it is stopped and resumed: transformers
imported before torch, fp16 autocast with torch's GradScaler on whatever device there is, its own
checkpoints (``experiments/user_scripts/hf_first_train.py``). Five checks, each with its evidence
in ``experiments/results/user_script.md``:

1. under the observer (``autoscale wrap --``) every loss and the final weights are bit-identical
   to the plain run's;
2. SIGTERM (a scheduler's preemption) mid-run: the command dies by it (exit 143), and the record
   and the exit line hold every step the script printed;
3. resumed from that checkpoint (written by the wrap's ``torch`` rule) under ``--scaler auto``:
   it loads, says in one line what carries over, and trains on; the plain script resumes from the
   same checkpoint with torch's own GradScaler;
4. the observed resume is bit-identical to the plain resume;
5. ``autoscale report`` on the stopped run's record, rendered by headless Chromium where one is
   installed (``user_script_report.png``).

    python experiments/user_script.py [--work /tmp/user-script] [--stop-at 150]
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "user_scripts" / "hf_first_train.py"
RESULTS = ROOT / "experiments" / "results"
AUTOSCALE = [sys.executable, "-m", "autoscale"]
STEP = re.compile(r"^step (\d+) loss (\S+) scale (\S+)$", re.M)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=1800)


def _losses(out: str) -> list[tuple[int, str]]:
    return [(int(m[1]), m[2]) for m in STEP.finditer(out)]


def _exit_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("autoscale wrap:")]


def _stop_at(argv: list[str], cwd: Path, step: int) -> tuple[int, str, str]:
    """Run ``argv``, send SIGTERM to it (the wrap: as a scheduler signals the job's process) once
    the script has printed ``step``; its exit status and output. Its stderr goes to a file, which
    no one reads while it runs (a pipe could fill and stop it)."""
    err_file = cwd / "stopped.err"
    with err_file.open("w") as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True)
        out = []
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.startswith(f"step {step} "):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=600)
    return proc.returncode, "".join(out) + rest, err_file.read_text()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", default="/tmp/user-script")
    p.add_argument("--stop-at", type=int, default=150)
    p.add_argument("--short", type=int, default=40, help="steps of the plain/observed comparison")
    args = p.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    script = [sys.executable, str(SCRIPT)]
    t0 = time.monotonic()
    ok: dict[str, bool] = {}
    lines: list[str] = []

    plain = _run([*script, "--steps", str(args.short)], work)
    observed = _run(
        [*AUTOSCALE, "wrap", "--record", "rec-short", "--", *script, "--steps", str(args.short)],
        work,
    )
    same = (
        _losses(plain.stdout) == _losses(observed.stdout)
        and len(_losses(plain.stdout)) == args.short
    )
    w = [re.search(r"weights sum (\S+)", r.stdout) for r in (plain, observed)]
    same_w = all(w) and w[0][1] == w[1][1]
    ok["observer"] = plain.returncode == observed.returncode == 0 and same and same_w
    lines += [
        f"**1. The observer changes nothing.** {args.short} steps plain and under `autoscale wrap --`: "
        f"{'every loss bit-identical' if same else 'LOSSES DIFFER'}, final weight sum "
        f"{w[0][1] if w[0] else '?'} plain and {w[1][1] if w[1] else '?'} observed; exit {plain.returncode} and "
        f"{observed.returncode}. Its exit line: `{' / '.join(_exit_lines(observed.stderr))}`.",
        "",
    ]

    rc, out, err = _stop_at(
        [
            *AUTOSCALE,
            "wrap",
            "--record",
            "rec",
            "--",
            *script,
            "--steps",
            "100000",
            "--ckpt",
            "ck.pt",
        ],
        work,
        args.stop_at,
    )
    printed = len(_losses(out))
    from autoscale.observe.record import read_record

    recorded = len(read_record(work / "rec").steps)
    said = re.search(r"\): (\d+) steps", " ".join(_exit_lines(err)))
    import torch

    saved = torch.load(work / "ck.pt", weights_only=False)["step"]
    ok["sigterm"] = rc == 143 and printed == recorded == int(said[1] if said else -1)
    lines += [
        f"**2. SIGTERM mid-run.** `autoscale wrap --record rec -- python hf_first_train.py --steps 100000 "
        f"--ckpt ck.pt`, sent SIGTERM once it printed step {args.stop_at}: exit {rc}; it printed "
        f"{printed} steps, the record holds {recorded}, the exit line says {said[1] if said else '?'}; "
        f"its last checkpoint is of step {saved}. Exit lines: `{' / '.join(_exit_lines(err))}`.",
        "",
    ]

    end = str(saved + 60)
    resume = ["--steps", end, "--resume", "ck.pt"]
    auto = _run(
        [*AUTOSCALE, "wrap", "--scaler", "auto", "--record", "rec-auto", "--", *script, *resume],
        work,
    )
    plain_r = _run([*script, *resume], work)
    observed_r = _run([*AUTOSCALE, "wrap", "--", *script, *resume], work)
    warned = [x.split("UserWarning: ")[-1] for x in auto.stderr.splitlines() if "loads into" in x]
    ok["resume"] = (
        auto.returncode == plain_r.returncode == 0
        and len(_losses(auto.stdout)) == len(_losses(plain_r.stdout)) == 60
        and "resumed at step" in plain_r.stdout
    )
    ok["observed resume"] = (
        _losses(plain_r.stdout) == _losses(observed_r.stdout) and observed_r.returncode == 0
    )
    head = lambda r: next((x for x in r.stdout.splitlines() if x.startswith("resumed")), "?")  # noqa: E731

    def last(r: subprocess.CompletedProcess) -> str:
        steps = _losses(r.stdout)
        return f"step {steps[-1][0]}, loss {steps[-1][1]}" if steps else "none"

    lines += [
        f"**3. Resumed under another scaler.** From that checkpoint to step {end}: under "
        f"`--scaler auto` it says `{head(auto)}` and, once, `{warned[0] if warned else 'no warning'}`; "
        f"exit {auto.returncode}, last {last(auto)}; its exit line "
        f"`{' / '.join(_exit_lines(auto.stderr))}`. The plain script resumes from the same "
        f"checkpoint with torch's GradScaler: `{head(plain_r)}`, exit {plain_r.returncode}, last "
        f"{last(plain_r)}.",
        "",
        f"**4. The observed resume is the plain resume.** "
        f"{'Every loss bit-identical' if ok['observed resume'] else 'LOSSES DIFFER'} over the 60 resumed steps.",
        "",
    ]

    report = _run([*AUTOSCALE, "report", "rec"], work)
    page = work / "rec" / "report.html"
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    shot = RESULTS / "user_script_report.png"
    if chromium and page.is_file():
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        subprocess.run([chromium, *flags, "--window-size=1200,2400", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, timeout=120)  # fmt: skip
    ok["report"] = (
        report.returncode == 0 and page.is_file() and (shot.is_file() or chromium is None)
    )
    lines += [
        f"**5. The report.** `autoscale report rec`: `{report.stdout.strip()}` (exit {report.returncode}); "
        + (
            "rendered by headless Chromium: [user_script_report.png](user_script_report.png)."
            if chromium
            else "no Chromium here: not rendered."
        ),
        "",
    ]

    import platform

    import transformers

    command = " ".join(
        ["python experiments/user_script.py", *(argv if argv is not None else sys.argv[1:])]
    )
    head_lines = [
        "# A user's script under `autoscale wrap`: stopped, resumed, reported",
        "",
        f"`{command}`",
        "",
        "[`experiments/user_scripts/hf_first_train.py`](../user_scripts/hf_first_train.py): a script "
        "in a user's own terms (transformers imported before torch, fp16 autocast with torch's "
        "GradScaler and gradient clipping, its own checkpoints). "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, device {'cuda' if torch.cuda.is_available() else 'cpu'}; took "
        f"{time.monotonic() - t0:.0f} s. Passed: {', '.join(k for k, v in ok.items() if v) or 'none'}"
        f"{'; FAILED: ' + ', '.join(k for k, v in ok.items() if not v) if not all(ok.values()) else ''}.",
        "",
    ]
    (RESULTS / "user_script.md").write_text("\n".join(head_lines + lines))
    print("\n".join(head_lines + lines))
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
