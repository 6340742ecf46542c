"""Export: a study's trial, a built-in rule or the shipped ``auto`` as a policy ``DIR/NAME/``
(:func:`export_candidate`), and the ranking and stored pick it exports from (:func:`rank`,
:func:`stored_pick`). RL trials are exported from the ``policy.zip`` artifact each stored, so any
trial can be exported later from any machine that sees the storage and the artifact store.
User-facing detail: docs/search.md, "Exported policies".
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import autoscale
from autoscale.envs.suite import SuiteSpec
from autoscale.errors import ConfigError, unknown_name
from autoscale.scalers.policies import PolicyManifest, staged_policy, write_manifest
from autoscale.scalers.registry import build_scaler, rule_class, rule_names
from autoscale.search.budget import plural
from autoscale.search.candidates import TORCH, Candidate
from autoscale.search.validate import Validated
from autoscale.training.scorecard import Scorecard, json_safe

if TYPE_CHECKING:
    from autoscale.search.choose import StoredPick

__all__ = [
    "trial_policy",
    "policy_label",
    "trial_factory",
    "extract_policy",
    "check_export_target",
    "stored_pick",
    "export_candidate",
    "card_summary",
    "rows_where",
    "top_candidates",
    "study_suites",
    "rank",
    "export_parametric",
]


def study_suites(
    study: Any, attrs: dict[str, Any] | None = None
) -> tuple[SuiteSpec, SuiteSpec, int]:
    """The ``(searched suite, validation suite, trace steps)`` a study was planned with."""
    attrs = study.user_attrs if attrs is None else attrs
    if "suite" not in attrs or "validation" not in attrs:
        raise ConfigError(
            f"study '{study.study_name}' was not made by this autoscale's search (it has no suite "
            "attributes); search it again under a new --study"
        )
    return (
        SuiteSpec.from_dict(attrs["suite"], source=f"study {study.study_name}"),
        SuiteSpec.from_dict(attrs["validation"], source=f"study {study.study_name}"),
        int(attrs.get("trace_steps", 0)),
    )


def trial_policy(trial: Any) -> dict[str, Any]:
    policy = trial.user_attrs.get("policy")
    if not policy:
        raise ConfigError(f"trial {trial.number} stored no policy (state {trial.state.name})")
    return policy


def policy_label(trial: Any) -> str:
    """``deepspeed, trial 12`` / ``torch defaults, trial 0`` (an enqueued built-in rule) /
    ``residual ppo agent, trial 3`` (on auto)."""
    p = trial_policy(trial)
    what = (
        p["rule"]
        if p["kind"] == "parametric"
        else f"residual {p['algo']} agent"
        if p["kind"] == "residual"
        else f"{p['algo']} agent"
    )
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


def trial_factory(trial: Any, suite: SuiteSpec, store: Any, workdir: Path) -> Callable[[], Any]:
    """A factory of fresh scalers running the trial's policy with the suite's scale bounds."""
    from autoscale.envs.episodes import scaler_for

    policy = trial_policy(trial)
    if policy["kind"] == "parametric":
        return lambda: scaler_for(policy["rule"], suite, **policy["params"])
    folder = extract_policy(trial, store, workdir / f"trial-{trial.number}")
    return lambda: scaler_for(str(folder), suite)


def top_candidates(
    complete: list[Any],
    suite: SuiteSpec,
    store: Any,
    workdir: Path,
    k: int,
    warn: Callable[[str], None],
    skip: set[int] | None = None,
    one_of: str | None = None,
) -> list[tuple[Any, Callable[[], Any]]]:
    """The ``k`` best complete trials with distinct policies, each with a factory of its scaler
    (enqueued defaults, ``skip`` and unloadable policies passed over). ``one_of``: a policy kind
    whose warm-started trial, else best, is added where the ``k`` lack it, so it reaches
    validation."""
    import json

    seen, out = set(), []
    ranked = [
        t
        for t in sorted(complete, key=lambda t: t.value)
        if "policy" in t.user_attrs
        and not t.user_attrs.get("baseline")
        and t.number not in (skip or ())
    ]
    kind = [t for t in ranked if t.user_attrs["policy"].get("kind") == one_of]

    def add(t: Any) -> None:
        key = json.dumps(t.user_attrs["policy"], sort_keys=True)
        if key in seen:
            return
        seen.add(key)
        try:
            out.append((t, trial_factory(t, suite, store, workdir)))
        except ConfigError as exc:
            warn(str(exc))

    for t in ranked:
        if len(out) == k:
            break
        add(t)
    if kind:  # the kind's warm-started trial or best, beside the k
        pick = next((t for t in kind if t.user_attrs.get("warm_start")), kind[0])
        if all(c.number != pick.number for c, _ in out):
            add(pick)
    return out


def rank(
    validated: dict[Candidate, Validated], reference: Validated, weights: Any
) -> list[Validated]:
    """Every validated scaler, best first by the objective against ``reference`` (``torch``);
    real-step rows before replayed ones, and on a tie ``auto``, then the rules (``torch`` first),
    then trials, then by key: the same order however ``validated`` was filled (the search's
    order of validation, or a study read back by ``autoscale export``)."""
    return sorted(
        validated.values(),
        key=lambda v: (
            not v.real,
            v.objective(reference, weights),
            v.key.kind != "policy",
            not v.key.is_rule,
            v.key != TORCH,
            v.key.number if v.key.is_trial else -1,  # trial 9 before trial 10
            str(v.key),
        ),
    )


def card_summary(
    cards: dict[str, list[Scorecard]],
    reference: dict[str, list[Scorecard]],
    weights: Any,
    where: str,
) -> dict[str, Any]:
    """Mean scorecard metrics, the objective and its terms, a row per member, and where."""
    from autoscale.search.objective import objective_terms
    from autoscale.search.trials import member_summary
    from autoscale.training import summarize

    episodes = [c for cs in cards.values() for c in cs]
    out: dict[str, Any] = {k: v["mean"] for k, v in summarize(episodes).items()}
    terms = objective_terms(cards, reference, weights)
    out["objective"] = terms["objective"]
    out["objective_terms"] = {k: v for k, v in terms.items() if k not in ("objective", "regrets")}
    out["members"] = member_summary(cards, reference, weights)
    out["evaluated_on"] = where
    return json_safe(out)


def rows_where(v: Validated, validation: SuiteSpec) -> str:
    """Where a validated row was measured, in words (real steps, or replayed windows)."""
    n, steps = sum(len(c) for c in v.cards.values()), validation.episode.steps
    if v.real:
        return f"real steps: {plural(n, 'test episode')} of {steps} steps"
    return f"replay of {n} held-out windows of {steps} recorded steps"


SEARCH_EXPORT = "autoscale search"  # the manifest's ``exported_by`` for a search's own export


def check_export_target(
    name: str,
    out_dir: Any,
    study_name: str,
    force: bool,
    *,
    own_study_ok: bool = True,
    storage: str | None = None,
    flag: str = "--export",
) -> bool:
    """Whether exporting ``name`` may replace an existing folder: with ``force``, or (with
    ``own_study_ok``) when it holds a search's own export of study ``study_name`` in ``storage``
    (masked URL), which a resumed search or another worker updates. ``flag``: the command's
    option that names the export, for the messages.

    Raises:
        ConfigError: a bad name, or a folder holding another policy without ``force``.
    """
    from autoscale.errors import PolicyError
    from autoscale.scalers.policies import (
        another_name,
        check_not_shipped,
        check_policy_name,
        default_policy_dir,
        existing_policy_error,
        read_manifest,
    )
    from autoscale.search.storage import same_storage

    root = Path(out_dir or default_policy_dir())
    dest = root / check_policy_name(name)
    check_not_shipped(name, root)
    _check_writable_folder(root)
    if not dest.exists() or force:
        return True
    try:
        workload = read_manifest(dest).workload
    except PolicyError as exc:  # half-written or corrupt: never replaced silently
        raise ConfigError(
            f"policy folder '{dest}' already exists and is not a readable policy "
            f"({str(exc).split('; ')[0]}); "
            f"remove it, {another_name(flag)}"
        ) from None
    if not (own_study_ok and workload.get("study") == study_name):
        other, there = workload.get("study"), workload.get("storage")
        if not other:
            raise existing_policy_error(dest, other=True, flag=flag)
        held = f"the export of study '{other}'" + (f" in {there}" if there else "")
        raise ConfigError(
            f"policy folder '{dest}' already exists and holds {held}, not of study "
            f"'{study_name}'; {another_name(flag)}"
        )
    by = workload.get("exported_by")
    # an earlier autoscale's search wrote no exported_by, but what it searched or validated on
    by_search = by == SEARCH_EXPORT or (
        by is None and ("searched_on" in workload or "validated_on" in workload)
    )
    there = workload.get("storage")
    if by_search and there is not None and storage is not None and same_storage(there, storage):
        return True
    if there is None or storage is None:
        held = f"an export of study '{study_name}' that does not name its storage"
    elif not same_storage(there, storage):
        held = f"the export of a study '{study_name}' in {there}"
    elif by == "autoscale export":
        held = f"a trial of study '{study_name}' exported by hand (autoscale export)"
    else:
        held = f"an export of study '{study_name}' that does not say a search made it"
    raise ConfigError(
        f"policy folder '{dest}' already exists and holds {held}, not this search's own; "
        + another_name(flag)
    )


def _check_writable_folder(root: Path) -> None:
    """Refuse a ``root`` this process cannot write in (a probe: permission bits lie for root)."""
    import tempfile

    if root.exists() and not root.is_dir():
        raise ConfigError(f"policy folder '{root}' is a file; pass --policy-dir DIR, a folder")
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        Path(tempfile.mkdtemp(prefix=".autoscale-probe-", dir=existing)).rmdir()
    except OSError as exc:
        raise ConfigError(
            f"cannot write policies to '{root}': '{existing}' is not a writable folder "
            f"({exc.strerror or exc}); pass --policy-dir DIR"
        ) from None


def _workload(study: Any, suite: SuiteSpec, extra: dict[str, Any]) -> dict[str, Any]:
    described = study.user_attrs.get("workload")
    if described is not None:  # what the study searched, in its own words (a search on records)
        base = dict(described)
    elif suite.is_single:
        base = {**suite.members[0].workload.to_dict(), "env": suite.members[0].name}
    else:
        base = {
            "suite": suite.name,
            "members": [m.name for m in suite.members],
            "left_out": [m.name for m in suite.left_out],
        }
    return {**base, "horizon": suite.episode.steps, "study": study.study_name, **extra}


def stored_pick(study: Any, validation: SuiteSpec, weights: Any) -> StoredPick:
    """What the search exports, decided by its own :func:`~autoscale.search.choose.choose` from
    what ``study`` holds: the real-step rows of any worker, the families searched, the verdicts
    of the latest pick's check and the refusals it stored. No check runs, so a scaler without a
    verdict is not the pick."""
    import optuna

    from autoscale.envs.suite_env import suite_instances
    from autoscale.search.choose import (
        CHECK_SHAPE,
        StoredPick,
        choose,
        family_refusal,
        stored_refusal,
    )
    from autoscale.search.validate import PREFIX, by_member, real_cards

    attrs, names = study.user_attrs, suite_instances(validation, "test")
    replay = "traces" in attrs  # a search on records: its rows are replay, all there is
    states = (optuna.trial.TrialState.COMPLETE,)
    complete = {t.number: t for t in study.get_trials(deepcopy=False, states=states)}
    rows: dict[Candidate, Validated] = {}
    for attr in attrs:
        try:
            key = Candidate.parse(attr[len(PREFIX) :]) if attr.startswith(PREFIX) else None
        except ValueError:
            key = None
        if key is None or not (key.is_named or key.number in complete):
            continue
        cards = real_cards(attrs, key, names)
        if len(cards) == len(names):
            label = key.name if key.is_named else policy_label(complete[key.number])
            rows[key] = Validated(key, label, by_member(cards, names), real=not replay)
    families = tuple(attrs.get("plan", {}).get("rules", ()))
    reference = rows.get(TORCH)
    if reference is None:
        return StoredPick(None, rows, None, families, weights)
    choice = choose(
        study, rank(rows, reference, weights), {}, None, None, None, weights=weights,
        stop_at=0.0, say=lambda text: None, replay_counts=replay, shape=attrs.get(CHECK_SHAPE),
        refuse=lambda v: stored_refusal(attrs, v.key) or family_refusal(v, study, families),
    )  # fmt: skip
    return StoredPick(choice, rows, reference, families, weights)


def export_candidate(
    study: Any,
    key: Candidate,
    name: str,
    *,
    suite: SuiteSpec,
    store: Any = None,
    out_dir: Any = None,
    force: bool = False,
    own_study_ok: bool = True,
    scorecard: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
    flag: str = "--export",
) -> tuple[Path, str]:
    """Export ``key`` as ``out_dir/NAME`` (nothing half-written on interrupt); returns the folder
    and what it holds, in words. ``auto`` is copied unchanged under the new name; a rule or
    parametric trial is exported with the episode's scale bounds; an agent from its artifact in
    ``store``. Replacing a folder follows :func:`check_export_target` (``flag``: the option
    that names the export, for its messages)."""
    from autoscale.scalers.policies import find_policy, read_manifest

    source = find_policy(key.name) if key.is_policy else None
    if key.is_policy and source is None:
        raise ConfigError(f"no installed policy '{key.name}' to export (autoscale list shows them)")
    replace = check_export_target(
        name,
        out_dir,
        study.study_name,
        force,
        own_study_ok=own_study_ok,
        storage=(provenance or {}).get("storage"),
        flag=flag,
    )
    trial = study.trials[key.number] if key.is_trial else None
    policy = trial_policy(trial) if trial is not None else {"kind": "named"}
    if key.is_policy:
        extra, how = (
            {"exported_policy": key.name},
            f"{key.name}, the shipped general policy, unchanged",
        )
    elif key.is_rule:
        extra, how = {"builtin_rule": key.name}, f"the built-in rule {key.name} with its defaults"
    else:
        extra, how = {"trial": trial.number}, policy_label(trial)
    workload = _workload(study, suite, {**extra, **(provenance or {})})
    scorecard = scorecard or {}
    if key.is_rule or policy["kind"] == "parametric":
        bounds = suite.episode.scale_kwargs()
        rule, params = (key.name, {}) if key.is_rule else (policy["rule"], policy["params"])
        kw = {"workload": workload, "scorecard": scorecard, "out_dir": out_dir, "force": replace}
        return export_parametric(rule, {**bounds, **params}, name, **kw), how
    with staged_policy(name, out_dir, force=replace) as tmp:
        if key.is_policy:  # the shipped policy's files; its manifest, renamed, below
            for f in source.iterdir():
                if f.is_file() and f.name != "policy.yaml":
                    shutil.copy2(f, tmp / f.name)
            manifest = read_manifest(source)
            workload = {**workload, "built": manifest.workload}
        else:  # the agent's folder as the trial stored it
            extract_policy(trial, store, tmp)
            manifest = read_manifest(tmp)
            workload = {**manifest.workload, **workload}
            scorecard = scorecard or manifest.scorecard
        write_manifest(
            tmp, dataclasses.replace(manifest, name=name, workload=workload, scorecard=scorecard)
        )
    return tmp.parent / name, how


def export_parametric(
    rule: str,
    parameters: dict[str, Any],
    name: str,
    *,
    workload: dict[str, Any] | None = None,
    scorecard: dict[str, Any] | None = None,
    out_dir: str | os.PathLike | None = None,
    force: bool = False,
) -> Path:
    """Export a rule with tuned parameters as ``out_dir/NAME`` (and its deepspeed.json if any)."""
    import torch

    cls = rule_class(rule)
    if cls is None:
        raise ConfigError(str(unknown_name("rule", rule, rule_names(), "autoscale list")))
    scaler = build_scaler(cls, "cpu", parameters)  # validates the parameters
    with staged_policy(name, out_dir, force=force) as tmp:
        manifest = PolicyManifest(
            name=name,
            kind="parametric",
            family=rule,
            parameters=dict(parameters),
            autoscale_version=autoscale.__version__,
            torch_version=torch.__version__,
            workload=workload or {},
            scorecard=scorecard or {},
        )
        write_manifest(tmp, manifest)
        try:
            block = scaler.rule.deepspeed_config(scaler.init_scale, scaler.min_scale)
        except ConfigError:
            block = None  # DeepSpeed cannot express this rule: no deepspeed.json
        if block is not None:
            (tmp / "deepspeed.json").write_text(json.dumps({"fp16": block}, indent=2) + "\n")
    return Path(tmp.parent) / name
