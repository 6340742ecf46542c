"""Public training scripts no one here wrote, run four ways: plain, under ``autoscale wrap --``
(the observer: the losses must be identical), under ``autoscale wrap --scaler auto`` and stopped
by SIGTERM mid-run under ``autoscale wrap --record``. Results: experiments/results/third_party.md.

    python experiments/third_party.py --work /tmp/tp/work \\
        --nanogpt /tmp/tp/nanoGPT --run-clm /tmp/tp/hf/run_clm.py \\
        --lightning /tmp/tp/lightning --timm /tmp/tp/timm --timm-python /tmp/tp/venv-tv/bin/python

Fetches nothing. Each argument is a copy the user got themselves (how, in the results file): a
work tree of karpathy/nanoGPT, huggingface/transformers'
``examples/pytorch/language-modeling/run_clm.py``, a work tree of Lightning-AI/pytorch-lightning
(its ``examples/pytorch/basics/transformer.py`` runs), a work tree of
huggingface/pytorch-image-models with a Python that imports torchvision (``--timm-python``).
Data and tiny models are made here from ``pydoc_data.topics`` (text shipped with Python) and
random images; with ``HF_HUB_OFFLINE=1`` nothing is downloaded. Scripts not given are skipped.
Prints a markdown table and writes ``summary.json`` under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

AUTOSCALE = [sys.executable, "-m", "autoscale"]
DEVICE = "cpu"  # --device: cuda runs the same scripts in the GPU tier


def _text() -> str:
    import pydoc_data.topics as topics

    return "".join(topics.topics[k] for k in sorted(topics.topics))


@dataclass
class Workload:
    """One script: its command for a run folder (short, or long for the SIGTERM case), the folder
    it runs in, and how its losses are read back from that folder and its output."""

    name: str
    command: object  # (run folder, long: bool) -> argv
    losses: object  # (run folder, output) -> list[float]
    cwd: Path | None = None  # None: the run folder
    term_after: int = 60
    env: dict[str, str] = field(default_factory=dict)


def nanogpt(repo: Path, work: Path) -> Workload:
    """nanoGPT's train.py (it reads configurator.py and data/ from its own folder) on a
    character-level corpus written as its get_batch reads it: uint16 ids in train.bin/val.bin,
    the vocabulary size in meta.pkl."""
    import numpy as np

    data = repo / "data" / "pydoc_char"
    data.mkdir(parents=True, exist_ok=True)
    text = _text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    ids[:cut].tofile(data / "train.bin")
    ids[cut:].tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)

    def command(run: Path, long: bool) -> list[str]:
        iters = 2000 if long else 40
        return [
            sys.executable, "train.py", "--dataset=pydoc_char", f"--device={DEVICE}", "--compile=False",
            "--dtype=float16", "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64",
            "--batch_size=8", "--gradient_accumulation_steps=1", "--eval_interval=20",
            "--eval_iters=5", "--log_interval=1", "--warmup_iters=5",
            "--always_save_checkpoint=False", f"--out_dir={run / 'out'}",
            f"--max_iters={iters}", f"--lr_decay_iters={iters}",
        ]  # fmt: skip

    def losses(run: Path, out: str) -> list[float]:
        return [float(x) for x in re.findall(r"^iter \d+: loss (\S+),", out, re.M)]

    return Workload("nanoGPT train.py", command, losses, cwd=repo, term_after=40)


def run_clm(script: Path, work: Path) -> Workload:
    """run_clm.py (imports datasets and evaluate before torch) training a 2-layer GPT-2 built
    from a local config and a byte-level BPE tokenizer trained here, on a local text file, with
    ``--fp16``; the Trainer's log history (trainer_state.json) holds the losses at full
    precision."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, PreTrainedTokenizerFast

    base = work / "clm"
    base.mkdir(parents=True, exist_ok=True)
    text = _text()
    (base / "train.txt").write_text(text)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=512, min_frequency=2, special_tokens=["<|eos|>"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer,
        bos_token="<|eos|>",
        eos_token="<|eos|>",
        model_max_length=64,
    )
    fast.save_pretrained(base / "tiny")
    GPT2Config(
        vocab_size=len(fast),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    ).save_pretrained(base / "tiny")

    def command(run: Path, long: bool) -> list[str]:
        return [
            sys.executable, str(script), "--config_name", str(base / "tiny"),
            "--tokenizer_name", str(base / "tiny"), "--train_file", str(base / "train.txt"),
            "--do_train", "--block_size", "64", "--per_device_train_batch_size", "8",
            "--logging_steps", "1", "--fp16", "--report_to", "none", "--save_strategy", "no",
            "--seed", "0", *(["--use_cpu"] if DEVICE == "cpu" else []),
            "--max_steps", "2000" if long else "30",
            "--output_dir", str(run / "out"),
        ]  # fmt: skip

    def losses(run: Path, out: str) -> list[float]:
        state = run / "out" / "trainer_state.json"
        if not state.exists():  # stopped before the Trainer saved its state: the printed rows
            return [float(x) for x in re.findall(r"\{'loss': '([^']+)'", out)]
        return [h["loss"] for h in json.loads(state.read_text())["log_history"] if "loss" in h]

    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return Workload("transformers run_clm.py", command, losses, term_after=75, env=env)


def lightning(repo: Path, work: Path) -> Workload:
    """Lightning's examples/pytorch/basics/transformer.py as shipped, its Trainer's defaults set
    the way Lightning reads them from the environment (PL_TRAINER_*): precision 16-mixed, a few
    steps, every step logged (on a CPU Lightning replaces 16-mixed by bf16-mixed, with a warning).
    Its WikiText2 demo reads ./data/wikitext-2.txt when present (else
    downloads): here a 1,000-word-vocabulary slice of the pydoc text, repeated. The losses are
    the train_loss scalars of its TensorBoard log."""
    data = work / "lightning-data"
    data.mkdir(parents=True, exist_ok=True)
    words = _text().split()
    (data / "wikitext-2.txt").write_text((" ".join(words[:3000]) + "\n") * 60)
    script = repo / "examples" / "pytorch" / "basics" / "transformer.py"

    def command(run: Path, long: bool) -> list[str]:
        (run / "data").mkdir(parents=True, exist_ok=True)
        shutil.copy(data / "wikitext-2.txt", run / "data" / "wikitext-2.txt")
        return ["env", f"PL_TRAINER_MAX_STEPS={2000 if long else 10}", sys.executable, str(script)]

    def losses(run: Path, out: str) -> list[float]:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        found = []
        for events in sorted(run.glob("lightning_logs/version_*")):
            acc = EventAccumulator(str(events))
            acc.Reload()
            if "train_loss" in acc.Tags()["scalars"]:
                found += [e.value for e in acc.Scalars("train_loss")]
        return found

    env = {
        "PL_TRAINER_PRECISION": "16-mixed",
        "PL_TRAINER_ACCELERATOR": "cpu" if DEVICE == "cpu" else "gpu",
        "PL_TRAINER_LOG_EVERY_N_STEPS": "1",
        "PL_TRAINER_LIMIT_VAL_BATCHES": "2",
        "PL_TRAINER_LIMIT_TEST_BATCHES": "2",
        "PL_TRAINER_ENABLE_PROGRESS_BAR": "0",
    }
    return Workload("Lightning transformer.py", command, losses, term_after=120, env=env)


def timm(repo: Path, work: Path, python: str) -> Workload:
    """timm's train.py with native AMP in float16 on the CPU (``--amp --amp-dtype float16
    --device cpu``: autocast, and no loss scaler, which it builds on CUDA only) training its
    test_resnet on random 32x32 images in ImageFolder layout."""
    import numpy as np
    from PIL import Image

    data = work / "timm-data"
    rng = np.random.default_rng(0)
    for split, n in (("train", 32), ("validation", 8)):
        for cls in ("a", "b"):
            folder = data / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")

    def command(run: Path, long: bool) -> list[str]:
        return [
            python, str(repo / "train.py"), "--data-dir", str(data), "--model", "test_resnet",
            "--num-classes", "2", "--img-size", "32", "-b", "8", "--epochs", "200" if long else "1",
            "--amp", "--amp-dtype", "float16", "--device", DEVICE, "--workers", "1",
            "--log-interval", "1", "--seed", "0", "--output", str(run / "out"),
            "--sched", "cosine", "--warmup-epochs", "0", "--no-prefetcher",
        ]  # fmt: skip

    def losses(run: Path, out: str) -> list[float]:
        return [float(x) for x in re.findall(r"Loss:\s+(\S+)\s+\(", out)]

    return Workload("timm train.py", command, losses, cwd=repo, term_after=60)


def _exit_lines(out: str) -> list[str]:
    # a progress bar may leave the cursor mid-line (tqdm ends its lines with \r only)
    return [
        line[line.index("autoscale wrap:") :]
        for line in out.splitlines()
        if "autoscale wrap:" in line
    ]


def _run(argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[int, str]:
    proc = subprocess.run(
        argv,
        cwd=cwd,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log.write_text(proc.stdout)
    return proc.returncode, proc.stdout


def study(w: Workload, work: Path) -> dict:
    """Runs one workload the four ways and returns what each showed."""
    res: dict = {"name": w.name}
    root = work / re.sub(r"\W+", "-", w.name)
    shutil.rmtree(root, ignore_errors=True)
    for way, prefix in (
        ("plain", []),
        ("wrap", [*AUTOSCALE, "wrap", "--"]),
        ("auto", [*AUTOSCALE, "wrap", "--scaler", "auto", "--"]),
    ):
        run = root / way
        run.mkdir(parents=True)
        argv = prefix + w.command(run, False)
        rc, out = _run(argv, w.cwd or run, w.env, run / "output.txt")
        res[way] = {"rc": rc, "losses": w.losses(run, out), "exit": _exit_lines(out), "argv": argv}
    run = root / "term"
    run.mkdir(parents=True)
    rec = run / "record"
    argv = [
        "timeout",
        "-s",
        "TERM",
        str(w.term_after),
        *AUTOSCALE,
        "wrap",
        "--record",
        str(rec),
        "--",
    ]
    argv += w.command(run, True)
    rc, out = _run(argv, w.cwd or run, w.env, run / "output.txt")
    report = subprocess.run(
        [*AUTOSCALE, "report", str(rec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    res["term"] = {
        "rc": rc,
        "losses": w.losses(run, out),
        "exit": _exit_lines(out),
        "argv": argv,
        "report_rc": report.returncode,
        "report": report.stdout.splitlines()[:12],
        "record_files": sorted(str(p.relative_to(rec)) for p in rec.rglob("*") if p.is_file())
        if rec.exists()
        else [],
    }
    plain, wrap = res["plain"]["losses"], res["wrap"]["losses"]
    res["identical"] = bool(plain) and plain == wrap
    return res


def table(results: list[dict]) -> str:
    rows = [
        "| script | plain rc, losses | wrap -- rc, identical | --scaler auto rc, exit line | SIGTERM rc, exit line | report rc |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['name']} | {r['plain']['rc']}, {len(r['plain']['losses'])} | {r['wrap']['rc']}, "
            f"{'yes' if r['identical'] else 'NO'} | {r['auto']['rc']}, {' / '.join(r['auto']['exit'])} | "
            f"{r['term']['rc']}, {' / '.join(r['term']['exit'])} | {r['term']['report_rc']} |"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--work", type=Path, required=True, help="folder for data, runs and summary.json"
    )
    ap.add_argument("--nanogpt", type=Path, help="work tree of karpathy/nanoGPT")
    ap.add_argument(
        "--run-clm", type=Path, help="transformers' examples/pytorch/language-modeling/run_clm.py"
    )
    ap.add_argument("--lightning", type=Path, help="work tree of Lightning-AI/pytorch-lightning")
    ap.add_argument("--timm", type=Path, help="work tree of huggingface/pytorch-image-models")
    ap.add_argument(
        "--timm-python", default=sys.executable, help="a Python whose torch has torchvision"
    )
    ap.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="where the scripts train"
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    args.work.mkdir(parents=True, exist_ok=True)
    loads = []
    if args.nanogpt:
        loads.append(nanogpt(args.nanogpt.resolve(), args.work))
    if args.run_clm:
        loads.append(run_clm(args.run_clm.resolve(), args.work))
    if args.lightning:
        loads.append(lightning(args.lightning.resolve(), args.work))
    if args.timm:
        loads.append(timm(args.timm.resolve(), args.work, args.timm_python))
    results = []
    for w in loads:
        print(f"== {w.name}", flush=True)
        results.append(study(w, args.work))
        (args.work / "summary.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
