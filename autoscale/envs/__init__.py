"""Gymnasium environments over real mixed-precision training steps, and their trace replay.

Importing this module registers ``autoscale/LossScale-v0`` and ``autoscale/LossScaleReplay-v0``::

    env = gymnasium.make("autoscale.envs:autoscale/LossScale-v0", spec="envs/gpt2-tiny.yaml")
"""

from gymnasium.envs.registration import register, registry

from autoscale.envs.base import ScaleEnvBase, step_reward
from autoscale.envs.loss_scale_env import LossScaleEnv
from autoscale.envs.replay_env import ReplayEnv
from autoscale.envs.spec import (
    EnvSpec,
    EpisodeSpec,
    InstanceSpec,
    RewardWeights,
    find_env_spec,
    load_env_spec,
)
from autoscale.envs.traces import Trace, record_trace

__all__ = [
    "EnvSpec",
    "EpisodeSpec",
    "InstanceSpec",
    "LossScaleEnv",
    "ReplayEnv",
    "RewardWeights",
    "ScaleEnvBase",
    "Trace",
    "find_env_spec",
    "load_env_spec",
    "record_trace",
    "step_reward",
]

for _id, _entry in (
    ("autoscale/LossScale-v0", "autoscale.envs.loss_scale_env:LossScaleEnv"),
    ("autoscale/LossScaleReplay-v0", "autoscale.envs.replay_env:ReplayEnv"),
):
    if _id not in registry:
        register(id=_id, entry_point=_entry, nondeterministic=True)
