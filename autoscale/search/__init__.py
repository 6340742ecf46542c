"""Budgeted Optuna search of loss-scale policies (docs/search.md). Imports Optuna (and, for RL
trials, Stable-Baselines3); ``import autoscale`` never loads this. Example::

    spec = base_spec(model="mlp", scenario="bad-batches")
    cfg = SearchConfig(spec, study="demo", export="demo-policy", storage="sqlite:///demo.db")
    result = SearchRunner(cfg, Budget.from_process_start(120)).run()
"""

from autoscale.search.budget import Budget, Ledger, format_duration, parse_budget
from autoscale.search.export import export_candidate, rank, stored_pick
from autoscale.search.objective import (
    OBJECTIVE_DOC,
    ROBUSTNESS,
    episode_cost,
    objective,
    objective_terms,
    regrets,
)
from autoscale.search.plan import Plan, make_plan
from autoscale.search.runner import SearchConfig, SearchResult, SearchRunner
from autoscale.search.storage import DEFAULT_STORAGE, artifact_store, artifacts_dir, open_storage
from autoscale.search.timing import Timing, Timings, measure, measure_all
from autoscale.search.workload import base_spec, default_study_name

__all__ = [
    "Budget",
    "DEFAULT_STORAGE",
    "Ledger",
    "OBJECTIVE_DOC",
    "Plan",
    "SearchConfig",
    "SearchResult",
    "SearchRunner",
    "Timing",
    "artifact_store",
    "artifacts_dir",
    "base_spec",
    "export_candidate",
    "rank",
    "regrets",
    "ROBUSTNESS",
    "Timings",
    "measure_all",
    "default_study_name",
    "episode_cost",
    "format_duration",
    "make_plan",
    "measure",
    "objective",
    "objective_terms",
    "open_storage",
    "parse_budget",
    "stored_pick",
]
