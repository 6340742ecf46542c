"""Export learned policies to ``DIR/NAME/`` (manifest + weights), ``DIR`` by default the folder
:func:`~autoscale.scalers.policies.default_policy_dir` names: the first of
``$AUTOSCALE_POLICY_PATH``, else the user's (``$AUTOSCALE_HOME/policies``, else
``$XDG_DATA_HOME/autoscale/policies``, else ``~/.local/share/autoscale/policies``).

A neural export turns a trained SB3 policy into a plain ``nn.Sequential`` actor (its state_dict in
``weights.pt``), so that :class:`~autoscale.scalers.neural.NeuralPolicyRule` runs it with torch
alone. Folders are staged and published by :func:`autoscale.scalers.policies.staged_policy`:
nothing is overwritten without ``force``, and an interrupted export leaves no half-written policy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoscale
from autoscale.errors import PolicyError
from autoscale.scalers.features import FEATURE_VERSION
from autoscale.scalers.policies import PolicyManifest, sha256_file, staged_policy, write_manifest

__all__ = ["sb3_actor", "export_neural"]

_ACT_NAMES = {
    nn.Tanh: "tanh",
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.ELU: "elu",
    nn.LeakyReLU: "leaky_relu",
}


def _flatten(seq: nn.Module, head: nn.Linear) -> tuple[nn.Sequential, list[int], str]:
    mods = (
        [m for m in seq.modules() if not isinstance(m, nn.Sequential)]
        if isinstance(seq, nn.Sequential)
        else []
    )
    mods = mods + [head]
    linears = [m for m in mods if isinstance(m, nn.Linear)]
    acts = {type(m) for m in mods if not isinstance(m, nn.Linear)}
    if len(acts) > 1:
        raise PolicyError(f"cannot export a policy network mixing activations {acts}")
    act = _ACT_NAMES.get(next(iter(acts))) if acts else "tanh"
    if act is None:
        raise PolicyError(
            f"cannot export activation {acts}; use one of {sorted(_ACT_NAMES.values())}"
        )
    layers = [linears[0].in_features] + [lin.out_features for lin in linears]
    from autoscale.scalers.neural import build_actor

    actor = build_actor(layers, act)
    for dst, src in zip([m for m in actor if isinstance(m, nn.Linear)], linears):
        dst.load_state_dict(src.state_dict())
    return actor, layers, act


def sb3_actor(model: Any) -> tuple[nn.Sequential, dict[str, Any]]:
    """The deterministic actor of a trained SB3 model as a plain Sequential, and its head.

    PPO/A2C: policy MLP + action_net (argmax for discrete actions, clip to [-1, 1] for
    continuous, as ``predict(deterministic=True)`` does); DQN: the Q-network (argmax); SAC: the
    actor's latent network + mu (tanh squashing).
    """
    policy = model.policy
    name = type(model).__name__.lower()
    discrete = hasattr(model.action_space, "n")
    if hasattr(policy, "mlp_extractor") and hasattr(policy, "action_net"):
        actor, layers, act = _flatten(policy.mlp_extractor.policy_net, policy.action_net)
        head = "argmax" if discrete else "clip"
    elif hasattr(policy, "q_net"):
        seq = policy.q_net.q_net
        linears = list(seq)
        actor, layers, act = _flatten(nn.Sequential(*linears[:-1]), linears[-1])
        head = "argmax"
    elif hasattr(policy, "actor") and hasattr(policy.actor, "latent_pi"):  # SAC
        actor, layers, act = _flatten(policy.actor.latent_pi, policy.actor.mu)
        head = "tanh"
    else:
        raise PolicyError(
            f"cannot export a {type(model).__name__} policy ({type(policy).__name__})"
        )
    return actor, {"algo": name, "layers": layers, "activation": act, "head": head}


def export_neural(
    model: Any,
    name: str,
    action: dict[str, Any],
    *,
    workload: dict[str, Any] | None = None,
    scorecard: dict[str, Any] | None = None,
    scales: dict[str, float] | None = None,
    obs_norm: dict[str, Any] | None = None,
    out_dir: str | os.PathLike | None = None,
    force: bool = False,
    kind: str = "neural",
    family: str | None = None,
) -> Path:
    """Export a trained SB3 model as ``out_dir/NAME`` (manifest + weights.pt): a ``kind``
    policy (``neural``, or ``residual``: its base rule and window among ``scales``) of
    ``family`` (default ``mlp-ALGO``)."""
    actor, params = sb3_actor(model)
    params = {**params, "action": action, **(scales or {})}
    with staged_policy(name, out_dir, force=force) as tmp:
        blob = {"actor": {k: v.detach().cpu().clone() for k, v in actor.state_dict().items()}}
        if obs_norm:
            blob["obs_norm"] = obs_norm
        torch.save(blob, tmp / "weights.pt")
        manifest = PolicyManifest(
            name=name,
            kind=kind,
            family=family or f"mlp-{params['algo']}",
            parameters=params,
            feature_version=FEATURE_VERSION,
            autoscale_version=autoscale.__version__,
            torch_version=torch.__version__,
            workload=workload or {},
            scorecard=scorecard or {},
            weights_sha256=sha256_file(tmp / "weights.pt"),
        )
        write_manifest(tmp, manifest)
    return Path(tmp.parent) / name
