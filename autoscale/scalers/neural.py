"""``PolicyScaler``: runs an exported neural policy as a loss scaler, with torch alone.

The policy reads the shared features (:mod:`autoscale.scalers.features`) after every step and
picks the change of log2(scale) deterministically, exactly as it did in the environment: the
first decision is taken at construction, from the features of a fresh run at ``init_scale``, as
the environment takes it at reset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoscale.errors import PolicyError
from autoscale.scalers.actions import ActionMap
from autoscale.scalers.base import LossScaler, StepStats
from autoscale.scalers.features import FEATURE_VERSION, N_FEATURES, FeatureExtractor
from autoscale.scalers.manifest import PolicyManifest, sha256_file
from autoscale.scalers.registry import register_policy_loader

__all__ = ["PolicyScaler", "build_actor", "ACTIVATIONS", "HEADS"]

ACTIVATIONS = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "elu": nn.ELU,
    "leaky_relu": nn.LeakyReLU,
}
HEADS = ("argmax", "clip", "tanh")


def build_actor(layers: list[int], activation: str) -> nn.Sequential:
    """The plain actor network of an exported policy: Linear layers with ``activation`` between."""
    if activation not in ACTIVATIONS:
        raise PolicyError(
            f"unknown activation '{activation}' in policy (known: {', '.join(ACTIVATIONS)})"
        )
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(layers[:-1], layers[1:])):
        mods.append(nn.Linear(a, b))
        if i < len(layers) - 2:
            mods.append(ACTIVATIONS[activation]())
    return nn.Sequential(*mods)


class PolicyScaler(LossScaler):
    """A loss scaler driven by an exported neural policy (``kind: neural``).

    Args:
        device: Device of the scale tensor (the policy itself runs on the CPU: it is tiny).
        manifest: The policy's manifest.
        actor: Its actor network.
        obs_norm: Optional ``{"mean": [...], "var": [...], "clip": c, "eps": e}`` applied to features.
        **kw: LossScaler arguments (``init_scale``, ``min_scale``, ``max_scale``, ...).
    """

    description = "an exported neural policy"
    source = "autoscale export"
    needs_stats = True

    def __init__(
        self,
        device: str | None = None,
        *,
        manifest: PolicyManifest,
        actor: nn.Sequential,
        obs_norm: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        p = manifest.parameters
        kw.setdefault("init_scale", p.get("init_scale", 2.0**16))
        kw.setdefault("min_scale", p.get("min_scale"))
        kw.setdefault("max_scale", p.get("max_scale"))
        super().__init__(device, **kw)
        self.name = manifest.name
        self.policy_name = manifest.name
        self.manifest = manifest
        self.actor = actor.eval()
        self.head = p["head"]
        self.action_map = ActionMap.from_dict(p["action"])
        self.features = FeatureExtractor()
        self._norm = None
        if obs_norm:
            mean = torch.tensor(obs_norm["mean"], dtype=torch.float32)
            std = torch.sqrt(
                torch.tensor(obs_norm["var"], dtype=torch.float32)
                + float(obs_norm.get("eps", 1e-8))
            )
            self._norm = (mean, std, float(obs_norm.get("clip", 10.0)))
        self._first_scale = float(kw["init_scale"])
        # The environment takes its first decision at reset, before any step: so does the scaler.
        self.start_episode(self._host_scale)

    def start_episode(self, scale: float, features_state: dict[str, Any] | None = None) -> float:
        """Load the features of the starting point and take the first decision from them."""
        if features_state is None:
            self.features.reset()
        else:
            self.features.load_state_dict(features_state)
        start = self.clamp(scale)
        self.set_scale(start * 2.0 ** self.decide(self.features.features(start)))
        return self.get_scale()

    @torch.no_grad()
    def act(self, features: list[float]) -> Any:
        """The deterministic action for a feature vector (an index, or a value in [-1, 1])."""
        x = torch.tensor(features, dtype=torch.float32).unsqueeze(0)
        if self._norm is not None:
            mean, std, clip = self._norm
            x = ((x - mean) / std).clamp(-clip, clip)
        out = self.actor(x)[0]
        if self.head == "argmax":
            return int(out.argmax().item())
        if self.head == "tanh":
            return out.tanh().numpy()
        return out.clamp(-1.0, 1.0).numpy()

    def decide(self, features: list[float]) -> float:
        """Bits to add to log2(scale) for a feature vector."""
        return self.action_map.delta(self.act(features))

    def next_scale(self, scale: float, stats: StepStats) -> float:
        return scale * 2.0 ** self.decide(self.features.observe(stats))

    def rule_params(self) -> dict[str, Any]:
        return {}

    def rule_state(self) -> dict[str, Any]:
        return {"features": self.features.state_dict()}

    def load_rule_state(self, state: dict[str, Any]) -> None:
        if "features" in state:
            self.features.load_state_dict(state["features"])

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.policy_name,
            "init_scale": self._first_scale,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }


def load_neural(
    path: Path, manifest: PolicyManifest, device: str | None, overrides: dict[str, Any]
) -> PolicyScaler:
    """Load ``path/weights.pt`` after checking its checksum and the feature version."""
    if manifest.feature_version != FEATURE_VERSION:
        raise PolicyError(
            f"policy '{manifest.name}' reads feature spec version {manifest.feature_version}, this autoscale computes "
            f"version {FEATURE_VERSION}; retrain and re-export it with this version"
        )
    p = manifest.parameters
    for key in ("layers", "activation", "head", "action"):
        if key not in p:
            raise PolicyError(
                f"policy '{manifest.name}' manifest lacks parameters.{key}; re-export it"
            )
    if p["head"] not in HEADS:
        raise PolicyError(
            f"policy '{manifest.name}' has unknown head '{p['head']}' (known: {', '.join(HEADS)})"
        )
    if p["layers"][0] != N_FEATURES:
        raise PolicyError(
            f"policy '{manifest.name}' expects {p['layers'][0]} features, the extractor gives {N_FEATURES}"
        )
    weights = path / "weights.pt"
    if not weights.is_file():
        raise PolicyError(f"policy '{manifest.name}' has no weights.pt in '{path}'; re-export it")
    digest = sha256_file(weights)
    if manifest.weights_sha256 and digest != manifest.weights_sha256:
        raise PolicyError(
            f"policy '{manifest.name}': weights.pt checksum {digest[:12]}... does not match the manifest's "
            f"{manifest.weights_sha256[:12]}...; the file is corrupt or was replaced, re-export the policy"
        )
    try:
        blob = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise PolicyError(
            f"policy '{manifest.name}': cannot load weights.pt ({exc.__class__.__name__}); re-export it"
        ) from exc
    actor = build_actor(list(p["layers"]), p["activation"])
    try:
        actor.load_state_dict(blob["actor"])
    except (KeyError, RuntimeError) as exc:
        raise PolicyError(
            f"policy '{manifest.name}': weights do not fit the manifest's network ({exc}); re-export it"
        ) from exc
    return PolicyScaler(
        device, manifest=manifest, actor=actor, obs_norm=blob.get("obs_norm"), **overrides
    )


register_policy_loader("neural", load_neural)
