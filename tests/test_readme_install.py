"""The README's install lines say what they do where a reader runs them: the main job's line
starts a 5-minute search right after the install (said before the line), and a CPU-only user on
the public index, where ``torch==2.13.0`` is a CUDA build on Linux, gets the CPU wheel's line."""

from __future__ import annotations

from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
MAIN_JOB = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    "pip install -e '.[search,hf]' && autoscale search --budget 5m"
)


def _before(line: str) -> str:
    """The paragraph just before ``line``'s code block."""
    head = README[: README.index(line)]
    paragraph = head[: head.rindex("```")].rstrip().rsplit("\n\n", 1)[-1]
    return " ".join(paragraph.split())


def test_the_main_job_line_says_it_runs_a_search_before_it_does():
    said = _before(MAIN_JOB)
    assert "then at once runs that 5-minute search" in said
    assert "`&& autoscale search --budget 5m`, to install only" in said


def test_a_cpu_only_user_is_given_the_cpu_wheel():
    flat = " ".join(README.split())
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in flat
    assert "on the public index (PyPI) the same version resolves to a CUDA build on Linux" in flat
    assert MAIN_JOB in README  # the line itself unchanged
