"""The general agent shipped with the package, from which a search's agents start.

The ``auto`` build's agents learn across the suite's train members (``experiments/knob_agents.py``
trains them under scenario knobs drawn per episode and compares them on the validation members);
the one that led there ships here as a Stable-Baselines3 model (``warm/general.zip``) with what it
is (``warm/general.yaml``: algorithm, stacked history, whether it acts at scale time, its actions,
and where it came from). ``autoscale search --space rl|both`` loads it for its first RL trial and
fine-tunes it on the user's replay (:class:`~autoscale.search.agent_trials.RLObjective`), so that the
agent's first trial starts from what the suite taught instead of from nothing. It is not a
registered scaler: it is a starting point, and what a search exports is judged against ``auto``
like any candidate.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from autoscale.errors import ConfigError

__all__ = ["RESIDUAL", "WARM_DIR", "WarmAgent", "shipped_agent", "ship_agent"]

WARM_DIR = Path(__file__).resolve().parent / "warm"
NAME = "general"
# the residual agent on auto (autoscale.agents.residual) a search's first RL trial fine-tunes
RESIDUAL = "residual"


@dataclasses.dataclass(frozen=True)
class WarmAgent:
    """A shipped SB3 agent: ``model`` (the saved zip) and how it observes and acts."""

    name: str
    algo: str
    history: int
    scale_time: bool
    action: dict[str, Any]
    model: Path
    info: dict[str, Any]
    window: int | None = None  # a residual agent: the steps its offsets hold (None: not residual)

    def episode_for(self, episode):
        """``episode`` (a search's :class:`~autoscale.envs.spec.EpisodeSpec`) observed and acted
        on as this agent does; raises :class:`ConfigError` where it cannot be (other actions, or
        a guard under an agent that acts at scale time)."""
        ep = dataclasses.replace(episode, history=self.history)
        if self.scale_time:
            if episode.guard is not None:
                raise ConfigError(
                    f"the shipped agent '{self.name}' acts at scale time; these episodes have a guard"
                )
            ep = ep.at_scale_time()
        if ep.action.to_dict() != self.action:
            raise ConfigError(
                f"the shipped agent '{self.name}' acts by {self.action}; this search's episodes by "
                f"{ep.action.to_dict()}"
            )
        return ep


def shipped_agent(folder: Path | None = None, which: str = NAME) -> WarmAgent | None:
    """The shipped general agent (``which``: :data:`NAME`, or :data:`RESIDUAL` for the residual
    one), or None when none ships (or its files are incomplete)."""
    from autoscale.yamlio import load_yaml

    folder = Path(folder) if folder is not None else WARM_DIR
    meta, model = folder / f"{which}.yaml", folder / f"{which}.zip"
    if not (meta.is_file() and model.is_file()):
        return None
    d = load_yaml(meta.read_text())
    return WarmAgent(
        name=str(d["name"]),
        algo=str(d["algo"]),
        history=int(d["history"]),
        scale_time=bool(d["scale_time"]),
        action=dict(d["action"]),
        model=model,
        info=dict(d.get("info") or {}),
        window=int(d["window"]) if d.get("window") is not None else None,
    )


def ship_agent(
    model_zip: Path,
    *,
    name: str,
    algo: str,
    history: int,
    scale_time: bool,
    action: dict[str, Any],
    info: dict[str, Any],
    folder: Path | None = None,
    which: str = NAME,
    window: int | None = None,
) -> WarmAgent:
    """Write ``model_zip`` and its description as the shipped agent (each file replaced whole:
    an interrupted write leaves the earlier file, never half of one)."""
    import yaml

    folder = Path(folder) if folder is not None else WARM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "name": name,
        "algo": algo,
        "history": history,
        "scale_time": scale_time,
        "action": action,
        "info": info,
        **({"window": window} if window is not None else {}),
    }
    with tempfile.TemporaryDirectory(dir=folder, prefix=".ship-") as tmp:
        shutil.copyfile(model_zip, Path(tmp) / f"{which}.zip")
        (Path(tmp) / f"{which}.yaml").write_text(
            "# the general agent a search's first RL trial starts from (autoscale/agents/warm.py)\n"
            + yaml.safe_dump(meta, sort_keys=False)
        )
        os.replace(Path(tmp) / f"{which}.zip", folder / f"{which}.zip")
        os.replace(Path(tmp) / f"{which}.yaml", folder / f"{which}.yaml")
    agent = shipped_agent(folder, which)
    assert agent is not None
    return agent
