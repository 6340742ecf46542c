"""The install: the base package is the run time, the search and Hugging Face models are extras,
and a command whose extra is missing says which one in one line (exit 2)."""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from autoscale.cli import NEEDS_EXTRA, main
from autoscale.errors import EXTRA_OF_MODULE, missing_extra

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _dist(requirement: str) -> str:
    """The distribution a requirement names, normalised as pip does (``stable_baselines3``)."""
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("-", "_")


def test_each_extra_module_comes_from_its_extra_and_never_from_the_base():
    base = {_dist(r) for r in PROJECT["dependencies"]}
    extras = PROJECT["optional-dependencies"]
    for module, extra in EXTRA_OF_MODULE.items():
        assert module in {_dist(r) for r in extras[extra]}, (module, extra)
        assert module not in base, module
    assert base == {"torch", "numpy", "pyyaml", "tqdm", "matplotlib"}


def test_the_dev_extra_installs_every_extra_the_tests_exercise():
    """README's test command and CI install ``.[dev,reference]``: the search and hf tests run."""
    assert "autoscale[search,hf]" in PROJECT["optional-dependencies"]["dev"]


def test_the_readme_and_ci_install_the_extras_their_commands_need():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[search,hf]' && autoscale search --budget 5m" in readme
    assert "pip install -e '.[dev,reference]' && python -m pytest -q" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pip install -e '.[dev,reference]'" in ci
    assert "\"$WHEEL\"'[search]'" in ci  # the wheel step runs `autoscale search`


class _Without(importlib.abc.MetaPathFinder):
    """An import finder that answers as if ``names`` (top-level modules) were not installed."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return None


@pytest.fixture
def without(monkeypatch):
    """Make the given top-level modules (and their submodules) unimportable for one test."""

    def hide(*names: str) -> None:
        for mod in [m for m in sys.modules if m.split(".")[0] in names]:
            monkeypatch.delitem(sys.modules, mod)
        monkeypatch.setattr(sys, "meta_path", [_Without(set(names)), *sys.meta_path])

    return hide


@pytest.mark.parametrize("command", sorted(NEEDS_EXTRA))
def test_a_command_without_its_extra_says_which_in_one_line(command, without, capsys):
    without("optuna")
    assert main([command, "--help"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"autoscale {command} needs the 'search' extra (optuna is not installed): "
        "pip install 'autoscale[search]'\n"
    )


def test_a_module_missing_midway_names_its_extra(without, capsys):
    """``run`` needs no extra, but a Hugging Face model needs 'hf': found when it is built."""
    without("transformers")
    assert main(["run", "--model", "gpt2-tiny", "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        "autoscale run needs the 'hf' extra (transformers is not installed): "
        "pip install 'autoscale[hf]'\n"
    )


def test_a_missing_module_that_no_extra_installs_is_not_hidden():
    assert missing_extra("autoscale run", "numpy") is None
    error = missing_extra("autoscale eval", "stable_baselines3.common.callbacks")
    assert str(error) == (
        "autoscale eval needs the 'search' extra (stable_baselines3 is not installed): "
        "pip install 'autoscale[search]'"
    )


@pytest.mark.slow  # a subprocess importing torch: seconds
def test_the_report_loads_without_the_search_extra():
    """``autoscale report`` reads records through ``autoscale.envs`` (specs and traces), which
    loads Gymnasium only with its environments."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class Without(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("gymnasium", "optuna", "stable_baselines3"):
                    raise ModuleNotFoundError(f"No module named '{name}'", name=name)

        sys.meta_path.insert(0, Without())
        import autoscale.envs
        from autoscale.report import write_report
        try:
            autoscale.envs.LossScaleEnv
        except ModuleNotFoundError as exc:
            print("LossScaleEnv needs", exc.name)
        """
    )
    out = _run(sys.executable, "-c", code, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "LossScaleEnv needs gymnasium\n"


TRAIN = textwrap.dedent(
    """
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for _ in range(12):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    print(type(scaler).__name__, scaler.get_scale())
    """
)


def _run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def _link_installed(name: str, site: Path, seen: set[str]) -> None:
    """Link distribution ``name`` and what it requires (not its extras) from this environment into
    ``site``, a fresh venv's site-packages; whatever ``site`` already has stays its own."""
    dist = importlib.metadata.distribution(name)
    if dist.metadata["Name"].lower() in seen:
        return
    seen.add(dist.metadata["Name"].lower())
    for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
        if not (site / top).exists() and not top.endswith(".pth"):
            (site / top).symlink_to(Path(dist.locate_file(top)))
    for requirement in dist.requires or []:
        if "extra ==" not in requirement:
            _link_installed(re.split(r"[<>=!~\[; (]", requirement, maxsplit=1)[0], site, seen)


@pytest.mark.slow  # a fresh virtual environment: torch from the local CPU wheel, then the package
def test_the_base_install_alone_wraps_a_run_and_names_the_missing_extra(tmp_path):
    """``pip install autoscale`` with no extra, in a fresh venv, from a copy of this checkout (not
    editable, so only what the package ships is there).

    The venv is created without ``--system-site-packages``: this one's Optuna, SB3 and
    transformers would be importable through it, and the point is that the base install has them
    not. torch alone (with what it requires) is linked in from this environment, where it is the
    CPU wheel the README installs: installing that wheel again unpacks several hundred MB and took
    minutes on a busy 2-core machine, for no more than pip finding torch installed. pip then
    installs the package and the rest of its dependencies as a user's ``pip install`` would. Then
    ``autoscale wrap --scaler auto`` runs a small fp16 loop with autoscale's scaler in place of
    GradScaler, ``autoscale report`` draws its page, and ``autoscale search`` says in one line
    which extra it needs.
    """
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for part in ("autoscale", "envs", "policies", "experiments/workloads"):
        shutil.copytree(ROOT / part, src / part, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, check=True)
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    site = Path(_run(py, "-c", "import site; print(site.getsitepackages()[0])").stdout.strip())
    _link_installed("torch", site, set())
    pip = (py, "-m", "pip", "install", "-q", "--disable-pip-version-check")
    done = _run(*pip, src, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]

    probe = "import importlib.util as u; print([m for m in %r if u.find_spec(m)])"
    heavy = ["optuna", "optuna_dashboard", "stable_baselines3", "gymnasium", "transformers"]
    assert _run(py, "-c", probe % heavy, check=True).stdout.strip() == "[]"

    work = tmp_path / "work"  # an empty folder: the package finds its policies as package data
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    wrapped = _run(
        bin_dir / "autoscale",
        "wrap",
        "--scaler",
        "auto",
        "--record",
        "rec",
        "--",
        "python",
        "train.py",
        cwd=work,
        env=env,
        timeout=300,
    )
    assert wrapped.returncode == 0, wrapped.stderr[-2000:]
    assert wrapped.stdout.startswith("LossScaler ")
    assert re.search(
        r"^autoscale wrap: auto \(rank 0\): 12 steps, \d+ skipped", wrapped.stderr, re.M
    )
    report = _run(bin_dir / "autoscale", "report", "rec", cwd=work, env=env, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    assert (work / "rec" / "report.html").stat().st_size > 10_000  # the page with its figures

    search = _run(bin_dir / "autoscale", "search", "--budget", "1m", cwd=work, env=env, timeout=120)
    assert (search.returncode, search.stdout) == (2, "")
    assert search.stderr == (
        "autoscale search needs the 'search' extra (optuna is not installed): "
        "pip install 'autoscale[search]'\n"
    )
