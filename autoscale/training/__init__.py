"""Training workloads, the instrumented AMP step and the scorecard.

A :class:`WorkloadSpec` names a model, data and a scenario (a reproduced loss-scaling failure);
a :class:`TrainingRun` trains it under any loss scaler, one measured :class:`StepRecord` per step,
and can :meth:`~TrainingRun.snapshot`/:meth:`~TrainingRun.restore` itself in memory; a
:class:`Scorecard` holds the metrics, defined once in :mod:`autoscale.training.scorecard`.

Example::

    from autoscale.training import TrainingRun, WorkloadSpec

    run = TrainingRun(WorkloadSpec(model="gpt2-tiny", scenario="bad-batches"), "torch")
    print(run.run(100).to_json())
"""

from autoscale.training.instruments import HIST_EDGES
from autoscale.training.presets import list_models
from autoscale.training.records import Snapshot, StepRecord
from autoscale.training.rl_finetune import RLFinetune  # registers the rl-finetune scenario
from autoscale.training.run import TrainingRun
from autoscale.training.scenarios import (
    Scenario,
    list_scenarios,
    register_scenario,
    unregister_scenario,
)
from autoscale.training.scorecard import (
    Scorecard,
    precision_loss_from_hist,
    step_metrics,
    summarize,
)
from autoscale.training.spec import WorkloadSpec

__all__ = [
    "HIST_EDGES",
    "RLFinetune",
    "Scenario",
    "Scorecard",
    "Snapshot",
    "StepRecord",
    "TrainingRun",
    "WorkloadSpec",
    "list_models",
    "list_scenarios",
    "precision_loss_from_hist",
    "register_scenario",
    "unregister_scenario",
    "step_metrics",
    "summarize",
]
