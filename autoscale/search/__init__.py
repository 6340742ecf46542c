"""Budgeted Optuna search of loss-scale policies (docs/search.md). Imports Optuna (and, for RL
trials, Stable-Baselines3); ``import autoscale`` never loads this. Example::

    spec = base_spec(model="mlp", scenario="bad-batches")
    cfg = SearchConfig(spec, study="demo", export="demo-policy", storage="sqlite:///demo.db")
    result = SearchRunner(cfg, Budget.from_process_start(120)).run()
"""

from autoscale.search.budget import Budget, parse_budget
from autoscale.search.runner import SearchConfig, SearchResult, SearchRunner
from autoscale.search.workload import base_spec, default_study_name

__all__ = [
    "Budget",
    "SearchConfig",
    "SearchResult",
    "SearchRunner",
    "base_spec",
    "default_study_name",
    "parse_budget",
]
