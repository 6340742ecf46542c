"""Export learned policies to ``policies/NAME/`` (manifest + weights), and rules to DeepSpeed JSON.

A neural export turns a trained SB3 policy into a plain ``nn.Sequential`` actor (its state_dict in
``weights.pt``), so that :class:`~autoscale.scalers.neural.PolicyScaler` runs it with torch alone.
Nothing is overwritten without ``force``; files are written to a temporary folder and moved into
place, so an interrupted export leaves no half-written policy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoscale
from autoscale.errors import ConfigError, PolicyError, UnknownNameError
from autoscale.scalers.features import FEATURE_VERSION
from autoscale.scalers.manifest import PolicyManifest, sha256_file, write_manifest

__all__ = [
    "sb3_actor",
    "export_neural",
    "export_parametric",
    "deepspeed_fp16_config",
    "default_policy_dir",
]

_ACT_NAMES = {
    nn.Tanh: "tanh",
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.ELU: "elu",
    nn.LeakyReLU: "leaky_relu",
}


def default_policy_dir() -> Path:
    """Where exports go: the first entry of ``$AUTOSCALE_POLICY_PATH``, else ``./policies``."""
    env = [p for p in os.environ.get("AUTOSCALE_POLICY_PATH", "").split(os.pathsep) if p]
    return Path(env[0]) if env else Path.cwd() / "policies"


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
    continuous, as ``predict(deterministic=True)`` does); DQN: the Q-network (argmax); SAC/TD3:
    the actor's latent network + mu (tanh squashing).
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
    elif hasattr(policy, "actor") and hasattr(policy.actor, "mu"):
        latent = policy.actor.latent_pi
        mu = policy.actor.mu
        if isinstance(mu, nn.Sequential):  # TD3-style actor: Linear + Tanh inside mu
            lin = [m for m in mu if isinstance(m, nn.Linear)]
            actor, layers, act = _flatten(latent, lin[-1])
        else:
            actor, layers, act = _flatten(latent, mu)
        head = "tanh"
    else:
        raise PolicyError(
            f"cannot export a {type(model).__name__} policy ({type(policy).__name__})"
        )
    return actor, {"algo": name, "layers": layers, "activation": act, "head": head}


def _publish(tmp: Path, dest: Path, force: bool) -> None:
    # mkdtemp/mkstemp make private (0700/0600) entries: give the policy the usual umask modes
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)
    if dest.exists():
        if not force:
            raise ConfigError(
                f"policy folder '{dest}' already exists; choose another --name or pass --force"
            )
        backup = dest.with_name(f".{dest.name}.old")
        if backup.exists():
            shutil.rmtree(backup)
        os.replace(dest, backup)
        os.replace(tmp, dest)
        shutil.rmtree(backup)
    else:
        os.replace(tmp, dest)


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise ConfigError(f"policy name '{name}' must use letters, digits, '-', '_' or '.' only")
    from autoscale.scalers.registry import _RULES, _builtin

    _builtin()
    if name in _RULES:
        raise ConfigError(f"policy name '{name}' is a built-in rule's name; choose another")


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
) -> Path:
    """Export a trained SB3 model as ``out_dir/NAME`` (manifest + weights.pt)."""
    _check_name(name)
    actor, params = sb3_actor(model)
    params = {**params, "action": action, **(scales or {})}
    root = Path(out_dir) if out_dir else default_policy_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
    try:
        blob = {"actor": {k: v.detach().cpu().clone() for k, v in actor.state_dict().items()}}
        if obs_norm:
            blob["obs_norm"] = obs_norm
        torch.save(blob, tmp / "weights.pt")
        manifest = PolicyManifest(
            name=name,
            kind="neural",
            family=f"mlp-{params['algo']}",
            parameters=params,
            feature_version=FEATURE_VERSION,
            autoscale_version=autoscale.__version__,
            torch_version=torch.__version__,
            workload=workload or {},
            scorecard=scorecard or {},
            weights_sha256=sha256_file(tmp / "weights.pt"),
        )
        write_manifest(tmp, manifest)
        _publish(tmp, root / name, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root / name


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
    """Export a rule with tuned parameters as ``out_dir/NAME`` (manifest only; + deepspeed.json
    when DeepSpeed can express the rule)."""
    from autoscale.scalers.registry import get_scaler

    _check_name(name)
    try:
        get_scaler(rule, device="cpu", **parameters)  # validates rule and parameters
    except UnknownNameError as exc:
        raise ConfigError(str(exc)) from exc
    root = Path(out_dir) if out_dir else default_policy_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
    try:
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
            import json

            (tmp / "deepspeed.json").write_text(
                json.dumps({"fp16": deepspeed_fp16_config(rule, parameters)}, indent=2) + "\n"
            )
        except ConfigError:
            pass
        _publish(tmp, root / name, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root / name


def deepspeed_fp16_config(rule: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed ``fp16`` config block equivalent to a rule, where DeepSpeed can express it.

    DeepSpeed fixes the growth and backoff factors at 2 and 1/2 and has no statistics-driven rules.

    Raises:
        ConfigError: the rule (or a parameter value) has no DeepSpeed equivalent.
    """
    import math

    from autoscale.scalers.registry import get_scaler

    s = get_scaler(rule, device="cpu", **parameters)
    init = s.get_scale()
    if rule == "static":  # any value: DeepSpeed's loss_scale is a float
        return {"enabled": True, "loss_scale": init}
    power = math.log2(init)
    if power != int(power):
        raise ConfigError(
            f"DeepSpeed takes initial_scale_power (a power of two); init_scale {init:g} is not one"
        )
    # DeepSpeedFP16Config declares min_loss_scale an int: a floor under 1 (torch's rule keeps 2^-24)
    # becomes 1, the lowest DeepSpeed can hold.
    if s.min_scale > 1 and s.min_scale != int(s.min_scale):
        raise ConfigError(
            f"DeepSpeed's min_loss_scale is an integer; min_scale {s.min_scale:g} is not one "
            f"(use min_scale={int(s.min_scale)} or {int(s.min_scale) + 1})"
        )
    block: dict[str, Any] = {
        "enabled": True,
        "initial_scale_power": int(power),
        "min_loss_scale": max(1, int(s.min_scale)),
    }
    if rule == "deepspeed":
        if s.scale_factor != 2.0:
            raise ConfigError(
                f"DeepSpeed's config fixes scale_factor at 2; this rule uses {s.scale_factor:g}"
            )
        return {
            **block,
            "loss_scale": 0,
            "loss_scale_window": s.loss_scale_window,
            "hysteresis": s.hysteresis,
            "consecutive_hysteresis": s.consecutive_hysteresis,
        }
    if rule in ("torch", "jmp", "megatron"):
        p = s.rule_params()  # each rule's own knobs (not GradScaler's inherited defaults)
        if rule == "jmp":
            growth, backoff, window = p["factor"], 1.0 / p["factor"], p["period"]
        else:
            growth, backoff, window = p["growth_factor"], p["backoff_factor"], p["growth_interval"]
        if growth != 2.0 or backoff != 0.5:
            raise ConfigError(
                f"DeepSpeed fixes the factors at 2 and 1/2; rule '{rule}' uses {growth:g} and {backoff:g}"
            )
        hysteresis = getattr(s, "hysteresis", 1)
        # DeepSpeed's first growth comes after window+1 clean steps, torch/jmp/megatron's after
        # `window`: window-1 matches the first growth; DeepSpeed's later growths then come every
        # window-1 steps instead of every window (DeepSpeed cannot express the rule exactly).
        return {
            **block,
            "loss_scale": 0,
            "loss_scale_window": max(1, window - 1),
            "hysteresis": hysteresis,
            "consecutive_hysteresis": False,
        }
    raise ConfigError(
        f"rule '{rule}' cannot be expressed in DeepSpeed's fp16 block (it supports static scales and the "
        "hysteresis/window rule only); use autoscale's scaler through a torch training loop instead"
    )
