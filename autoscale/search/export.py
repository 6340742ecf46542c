"""Export a study's trial as a policy (``policies/NAME/``), and pick a study's best trial.

Parametric trials are re-exported from their parameters; RL trials from the policy each one
stored as an artifact (``policy.zip``) when it completed, so any trial can be exported later,
from any machine that sees the storage and the artifact store.
"""

from __future__ import annotations

import dataclasses
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.envs.spec import EnvSpec
from autoscale.errors import ConfigError
from autoscale.search.objective import objective
from autoscale.search.validate import validated_trials
from autoscale.training.scorecard import Scorecard, json_safe

__all__ = [
    "trial_policy",
    "policy_label",
    "trial_factory",
    "extract_policy",
    "check_export_target",
    "export_trial",
    "best_trial",
    "card_summary",
    "top_candidates",
    "study_spec",
]


def study_spec(study: Any) -> EnvSpec:
    """The env spec a study was searched with (stored by ``autoscale search``)."""
    data = study.user_attrs.get("env_spec")
    if not data:
        raise ConfigError(
            f"study '{study.study_name}' was not made by autoscale search (it has no env_spec attribute)"
        )
    return EnvSpec.from_dict(data, source=f"study {study.study_name}")


def trial_policy(trial: Any) -> dict[str, Any]:
    policy = trial.user_attrs.get("policy")
    if not policy:
        raise ConfigError(f"trial {trial.number} stored no policy (state {trial.state.name})")
    return policy


def policy_label(trial: Any) -> str:
    """``deepspeed, trial 12`` / ``torch defaults, trial 0`` (an enqueued built-in rule) /
    ``ppo agent, trial 3``."""
    p = trial_policy(trial)
    what = p["rule"] if p["kind"] == "parametric" else f"{p['algo']} agent"
    if trial.user_attrs.get("baseline"):
        what += " defaults"
    return f"{what}, trial {trial.number}"


def extract_policy(trial: Any, store: Any, dest: Path) -> Path:
    """Unpack an RL trial's stored policy folder into ``dest`` (created)."""
    from optuna.artifacts import download_artifact

    policy = trial_policy(trial)
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "policy.zip"
    try:
        download_artifact(
            artifact_store=store, artifact_id=policy["artifact_id"], file_path=str(archive)
        )
    except Exception as exc:
        raise ConfigError(
            f"trial {trial.number}'s policy artifact {policy['artifact_id']} cannot be read ({exc}); "
            "pass the --artifacts folder of the search that made it"
        ) from None
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(dest)
    archive.unlink()
    return dest


def trial_factory(trial: Any, spec: EnvSpec, store: Any, workdir: Path) -> Callable[[], Any]:
    """A factory of fresh scalers running the trial's policy with the spec's scale bounds."""
    from autoscale.agents.evaluate import scaler_for

    policy = trial_policy(trial)
    if policy["kind"] == "parametric":
        return lambda: scaler_for(policy["rule"], spec, **policy["params"])
    folder = extract_policy(trial, store, workdir / f"trial-{trial.number}")
    return lambda: scaler_for(str(folder), spec)


def top_candidates(
    complete: list[Any],
    spec: EnvSpec,
    store: Any,
    workdir: Path,
    k: int,
    warn: Callable[[str], None],
) -> list[tuple[Any, Callable[[], Any]]]:
    """The ``k`` best complete trials (by their train objective) with distinct policies, each
    with a factory of its scaler; a trial whose policy cannot be loaded here is skipped."""
    import json

    seen, out = set(), []
    for t in sorted(complete, key=lambda t: t.value):
        if "policy" not in t.user_attrs:
            continue
        key = json.dumps(t.user_attrs["policy"], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        try:
            out.append((t, trial_factory(t, spec, store, workdir)))
        except ConfigError as exc:
            warn(str(exc))
        if len(out) == k:
            break
    return out


def card_summary(cards: list[Scorecard], weights: Any, where: str) -> dict[str, Any]:
    """Mean of every scorecard metric over ``cards``, the objective and where it was measured."""
    from autoscale.training import summarize

    out: dict[str, Any] = {k: v["mean"] for k, v in summarize(cards).items()}
    out["objective"] = objective(cards, weights)
    out["evaluated_on"] = where
    return json_safe(out)


def check_export_target(
    name: str, out_dir: Any, study_name: str, force: bool, *, own_study_ok: bool = True
) -> bool:
    """Whether exporting ``name`` may replace an existing folder: with ``force``, or (with
    ``own_study_ok``) when that folder holds an earlier export of the same study, which a resumed
    search or another worker of the study updates.

    Raises:
        ConfigError: a bad name, or a folder holding another policy without ``force``.
    """
    from autoscale.errors import PolicyError
    from autoscale.scalers.policies import (
        check_policy_name,
        default_policy_dir,
        existing_policy_error,
        read_manifest,
    )

    dest = Path(out_dir or default_policy_dir()) / check_policy_name(name)
    if not dest.exists() or force:
        return True
    try:
        ours = own_study_ok and read_manifest(dest).workload.get("study") == study_name
    except PolicyError:
        ours = False
    if not ours:
        raise existing_policy_error(dest, other=True)
    return True


def export_trial(
    study: Any,
    trial: Any,
    name: str,
    *,
    spec: EnvSpec,
    store: Any,
    out_dir: Any = None,
    force: bool = False,
    own_study_ok: bool = True,
    scorecard: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Export ``trial``'s policy as ``out_dir/NAME`` (nothing half-written on interrupt).

    The manifest's workload records the spec, the study and the trial; ``scorecard`` is its
    summary (validation on real steps where there is one). Replacing an existing folder follows
    :func:`check_export_target`.
    """
    from autoscale.agents.export import export_parametric
    from autoscale.scalers.policies import read_manifest, staged_policy, write_manifest

    replace = check_export_target(name, out_dir, study.study_name, force, own_study_ok=own_study_ok)
    policy = trial_policy(trial)
    ep = spec.episode
    workload = {
        **spec.workload.to_dict(),
        "env": spec.name,
        "episode_steps": ep.steps,
        "study": study.study_name,
        "trial": trial.number,
        **(provenance or {}),
    }
    scorecard = scorecard or {}
    if policy["kind"] == "parametric":
        params = {
            "init_scale": ep.init_scale,
            "min_scale": ep.min_scale,
            "max_scale": ep.max_scale,
            **policy["params"],
        }
        return export_parametric(
            policy["rule"],
            params,
            name,
            workload=workload,
            scorecard=scorecard,
            out_dir=out_dir,
            force=replace,
        )
    with staged_policy(name, out_dir, force=replace) as tmp:
        extract_policy(trial, store, tmp)
        manifest = read_manifest(tmp)
        write_manifest(
            tmp,
            dataclasses.replace(
                manifest,
                name=name,
                workload={**manifest.workload, **workload},
                scorecard=scorecard or manifest.scorecard,
            ),
        )
    return tmp.parent / name


def best_trial(study: Any, spec: EnvSpec) -> tuple[Any, list[Scorecard] | None, str]:
    """The study's best trial: the best validated on real test steps (by any worker) if any,
    else the best on the train replay. Returns ``(trial, real-step cards or None, how)``.

    Raises:
        ConfigError: the study has no completed trial.
    """
    import optuna

    complete = {
        t.number: t
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    }
    if not complete:
        raise ConfigError(f"study '{study.study_name}' has no completed trial to export")
    validated = {n: c for n, c in validated_trials(study, spec).items() if n in complete}
    if validated:
        n = min(validated, key=lambda k: objective(validated[k], spec.reward))
        return complete[n], validated[n], "best on real steps of the test instances"
    best = min(complete.values(), key=lambda t: t.value)
    return best, None, "best on the train replay (not validated on real steps)"
