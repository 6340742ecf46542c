"""Exported neural policies as a rule (:class:`NeuralPolicyRule`), run with torch alone.

The policy reads the shared features (:mod:`autoscale.scalers.features`) after every step and
picks the change of log2(scale) deterministically, exactly as it did in the environment: the
first decision is taken when the scaler is built, from the features of a fresh run at
``init_scale``, as the environment takes it at reset. A policy trained under a per-step loss
guard (``episode.guard``) carries it (``parameters.guard``): the scaler lowers each spike's
scale on the device, as for ``amax-loss``, and the policy's next decision starts from the scale
it set, as the agent's did in the environment.

A policy trained to act at scale time (``episode.scale_time``, ``parameters.scale_time``) takes
its decision when the loss is scaled instead, from the features of that loss
(:mod:`~autoscale.scalers.scale_time`) beside the stacked after-step ones: on the host for a CPU
scaler, on the loss's device otherwise (the after-step half of the first layer computed on the
host after the scaler's sync, the rest on the device: no host sync of its own). The scale the
step used comes back with the scaler's one read per step, and the next base scale is decoded
from it (:meth:`~autoscale.scalers.actions.ActionMap.base_after`).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoscale.errors import ConfigError, PolicyError
from autoscale.scalers.actions import ActionMap
from autoscale.scalers.controller import ScaleRule, StepStats
from autoscale.scalers.features import FEATURE_VERSION, N_FEATURES, FeatureExtractor, FrameStack
from autoscale.scalers.policies import PolicyManifest, register_policy_kind, sha256_file
from autoscale.scalers.registry import SCALER_OPTIONS
from autoscale.scalers.rules.guard import LossGuard
from autoscale.scalers.scale_time import N_SCALE_TIME, LossNow
from autoscale.scalers.scaler import LossScaler

__all__ = [
    "NeuralPolicyRule",
    "act_with",
    "build_actor",
    "load_weights",
    "load_neural",
    "deepspeed_refusal",
    "ACTIVATIONS",
    "HEADS",
]

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


class act_with:  # noqa: N801  (a callable, named for what calling it does)
    """``act(features)``: the deterministic action of ``actor`` for a feature vector (an index
    for the ``argmax`` head, else a value in [-1, 1]), the features normalised by ``norm``
    ((mean, std, clip)) first where given. Shared by the neural and the residual policies; an
    object, not a closure, so that a scaler holding one pickles."""

    def __init__(
        self, actor: nn.Module, head: str, norm: tuple[torch.Tensor, torch.Tensor, float] | None
    ) -> None:
        self.actor, self.head, self.norm = actor, head, norm

    @torch.no_grad()
    def __call__(self, features: list[float]) -> Any:
        x = torch.tensor(features, dtype=torch.float32).unsqueeze(0)
        if self.norm is not None:
            mean, std, clip = self.norm
            x = ((x - mean) / std).clamp(-clip, clip)
        out = self.actor(x)[0]
        if self.head == "argmax":
            return int(out.argmax().item())
        if self.head == "tanh":
            return out.tanh().numpy()
        return out.clamp(-1.0, 1.0).numpy()


class NeuralPolicyRule(ScaleRule):
    """The rule of an exported neural policy (``kind: neural``): its actor picks each step's change
    of log2(scale) from the shared features.

    Args:
        manifest: The policy's manifest.
        actor: Its actor network (runs on the CPU: it is tiny).
        obs_norm: Optional ``{"mean": [...], "var": [...], "clip": c, "eps": e}`` applied to features.
    """

    description = "an exported neural policy"
    source = "autoscale export"
    needs_stats = True
    needs_loss = True  # its features read the loss (trend, non-finite)

    def __init__(
        self,
        *,
        manifest: PolicyManifest,
        actor: nn.Sequential,
        obs_norm: dict[str, Any] | None = None,
    ) -> None:
        p = manifest.parameters
        self.manifest = manifest
        self.actor = actor.eval()
        self.head = p["head"]
        self.action_map = ActionMap.from_dict(p["action"])
        self.features = FeatureExtractor()
        self.stack = FrameStack(int(p.get("history", 1)))
        guard = p.get("guard")
        self.guard = LossGuard(**guard) if guard else None
        self.scale_time = bool(p.get("scale_time", False))
        self.loss_now = LossNow()
        # a guard, or its own decision at scale time: either way the scaler calls it then
        self.has_guard = self.guard is not None or self.scale_time
        self.base = math.nan  # the scale the controller set last from this policy's wish
        self._device: dict[Any, Any] = {}  # device -> the actor's tensors there (scale time)
        self._warned = False  # that a step came without a loss to decide from
        self._norm = None
        self._act: Any = None  # act_with(...), built at the first decision
        if obs_norm:
            mean = torch.tensor(obs_norm["mean"], dtype=torch.float32)
            std = torch.sqrt(
                torch.tensor(obs_norm["var"], dtype=torch.float32)
                + float(obs_norm.get("eps", 1e-8))
            )
            self._norm = (mean, std, float(obs_norm.get("clip", 10.0)))

    def start(self, scale: float, features_state: dict[str, Any] | None = None) -> float:
        """Load the features of the starting point and take the first decision from them."""
        if features_state is None:
            self.features.reset()
        else:
            self.features.load_state_dict(features_state)
        frames = self.stack.reset(self.features.features(scale))
        if self.scale_time:  # the first decision waits for the first loss
            self.loss_now = LossNow()
            return scale
        return scale * 2.0 ** self.decide(frames)

    def act(self, features: list[float]) -> Any:
        """The deterministic action for a feature vector (an index, or a value in [-1, 1])."""
        if self._act is None:
            self._act = act_with(self.actor, self.head, self._norm)
        return self._act(features)

    def decide(self, features: list[float]) -> float:
        """Bits to add to log2(scale) for a feature vector."""
        return self.action_map.delta(self.act(features))

    def guard_limit(self) -> float | None:
        return self.guard.guard_limit() if self.guard is not None else None

    # ------------------------------------------------------------------ at scale time
    def step_scale(self, scale: float, loss: float, bounds: Any) -> float:
        """This step's scale from its loss, when the rule set ``scale`` (host floats)."""
        obs = self.stack.vector() + self.loss_now.features(loss, scale)
        return bounds.clamp(scale * 2.0 ** self.decide(obs))

    @torch.no_grad()
    def apply_step_scale(
        self, scale: torch.Tensor, loss: torch.Tensor, bounds: Any, set_scale: float, group: Any
    ) -> torch.Tensor | None:
        """Write this step's scale into ``scale`` (the scaler's scale tensor): on the host where
        reading the loss is no sync (a CPU scaler outside torch.distributed; returns None), else
        on the device (returns the scale, float64). Under torch.distributed the ranks decide from
        the largest ``|loss|``, so that they agree."""
        dev = scale.device
        if dev.type == "cpu" and loss.device.type == "cpu" and group is None:
            scale.fill_(self.step_scale(set_scale, float(loss), bounds))
            return None
        exact = torch.float32 if dev.type == "mps" else torch.float64
        g = loss.detach().to(dev, exact, copy=True).reshape(()).abs_()
        if group is not None:
            from autoscale.scalers.ranks import RankAgreement

            g = RankAgreement.max_loss(g, group)
        bits = self.device_bits(set_scale, g)
        out = (bits.to(exact).exp2() * set_scale).clamp_(bounds.min_scale, bounds.max_scale)
        out = out.to(torch.float32).to(exact)  # rounded to float32, as ScaleBounds.clamp does
        scale.copy_(out)
        return out

    def device_bits(self, set_scale: float, loss: torch.Tensor) -> torch.Tensor:
        """The bits :meth:`step_scale` adds, computed on ``loss``'s device: the after-step half
        of the first layer on the host (a copy, no sync), the loss's half and the rest there."""
        dev = loss.device
        parts = self._device.get(dev)
        if parts is None:
            parts = self._device[dev] = self._device_parts(dev)
        first_now, rest, table, now_norm = parts
        past = torch.tensor(self.stack.vector(), dtype=torch.float32)
        n_past = past.numel()
        if self._norm is not None:
            mean, std, clip = self._norm
            past = ((past - mean[:n_past]) / std[:n_past]).clamp(-clip, clip)
        first = self.actor[0]
        pre = torch.addmv(first.bias, first.weight[:, :n_past], past)
        # CUDA: an asynchronous copy from page-locked memory, no sync; torch's caching host
        # allocator keeps the block until the copy has run
        pre = pre.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else pre.to(dev)
        now = self.loss_now.device_features(loss, set_scale).to(torch.float32)
        if now_norm is not None:
            mean, std, clip = now_norm
            now = ((now - mean) / std).clamp(-clip, clip)
        out = rest(torch.addmv(pre, first_now, now).unsqueeze(0))[0]
        if self.head == "argmax":
            return table[out.argmax()]
        value = out.tanh() if self.head == "tanh" else out.clamp(-1.0, 1.0)
        bits = value[0].clamp(-1.0, 1.0) * self.action_map.max_delta
        res = self.action_map.resolution
        return torch.round(bits / res) * res if res > 0 else bits

    def _device_parts(self, dev: Any) -> tuple:
        import copy

        first = self.actor[0]
        n_now = N_SCALE_TIME
        first_now = first.weight[:, -n_now:].detach().to(dev)
        rest = copy.deepcopy(self.actor[1:]).to(dev).eval()
        a = self.action_map
        table = torch.tensor(
            [a.delta(i) for i in range(a.n)] if a.mode == "discrete" else [0.0],
            dtype=torch.float32,
            device=dev,
        )
        now_norm = None
        if self._norm is not None:
            mean, std, clip = self._norm
            now_norm = (mean[-n_now:].to(dev), std[-n_now:].to(dev), clip)
        return first_now, rest, table, now_norm

    def adopt(self, scale: float) -> None:
        self.base = scale

    def next_scale(self, scale: float, stats: StepStats) -> float:
        if self.scale_time:  # the decision was taken at scale time: keep the books, decode
            if not stats.loss_seen and not self._warned:
                self._warned = True
                warnings.warn(
                    f"policy '{self.manifest.name}' picks each step's scale when the loss is "
                    "scaled, but scaler.scale() got no single-element loss this step, so the "
                    "step kept the scale set before; pass the loss tensor itself: "
                    "scaler.scale(loss)",
                    stacklevel=2,
                )
            self.features.update(stats)
            self.loss_now.update(stats)
            base = self.base if self.base == self.base else scale
            out = self.action_map.base_after(stats.scale, base)
            self.stack.push(self.features.features(out))
            return out
        if self.guard is not None:
            self.guard.observe(scale, stats)
            if stats.guarded and self.base == self.base:  # from the scale it set, not the spike's
                scale = self.base
        return scale * 2.0 ** self.decide(self.stack.push(self.features.observe(stats)))

    def state(self) -> dict[str, Any]:
        out = {"features": self.features.state_dict(), "stack": self.stack.state_dict()}
        if self.scale_time:
            out.update(
                loss_now=self.loss_now.state_dict(),
                base=None if self.base != self.base else self.base,
            )
        if self.guard is not None:
            out.update(self.guard.state(), base=None if self.base != self.base else self.base)
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ConfigError(
                f"policy '{self.manifest.name}': state must be a mapping, got {type(state).__name__}"
            )
        if self.scale_time and "loss_now" in state:
            self.loss_now.load_state_dict(state["loss_now"])
        if self.guard is not None or self.scale_time:
            if self.guard is not None:
                self.guard.load_state(state, f"policy '{self.manifest.name}'")
            base = state.get("base")
            self.base = float(base) if isinstance(base, (int, float)) and base > 0 else math.nan
        if "features" in state:
            try:
                self.features.load_state_dict(state["features"])
                if "stack" in state:
                    self.stack.load_state_dict(state["stack"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(
                    f"policy '{self.manifest.name}': the checkpoint's feature state is malformed "
                    f"({type(exc).__name__}: {exc}); it was not written by this policy"
                ) from None

    def deepspeed_config(self, init_scale: float, min_scale: float) -> dict[str, Any]:
        raise deepspeed_refusal(self.manifest.name, "neural")


def deepspeed_refusal(name: str, kind: str) -> ConfigError:
    """Why a policy of ``kind`` (not parametric) has no DeepSpeed ``fp16`` block."""
    what = "a network that picks each step's scale" if kind == "neural" else f"kind '{kind}'"
    return ConfigError(
        f"policy '{name}' is a {kind} policy ({what}); DeepSpeed's fp16 block holds only a static "
        "scale or its hysteresis/window rule. Train it with autoscale's scaler instead "
        f"(get_scaler('{name}') in a torch, Accelerate or Lightning loop), or export a parametric "
        "policy for DeepSpeed"
    )


def load_neural(
    path: Path, manifest: PolicyManifest, device: str | None, overrides: dict[str, Any]
) -> LossScaler:
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
    history = p.get("history", 1)
    if isinstance(history, bool) or not isinstance(history, int) or history < 1:
        raise PolicyError(
            f"policy '{manifest.name}' has history {history!r}, not an integer >= 1; re-export it"
        )
    guard = p.get("guard")
    if guard is not None:
        try:
            LossGuard(**guard)
        except (TypeError, ConfigError) as exc:
            raise PolicyError(
                f"policy '{manifest.name}' has guard {guard!r}, not a mapping of guard_history "
                f"and guard_margin ({exc}); re-export it"
            ) from None
        if guard.get("spike_bits"):  # an agent's guard lowers scales; amax-loss skips spikes
            raise PolicyError(
                f"policy '{manifest.name}' has a guard with spike_bits={guard['spike_bits']!r}: "
                "a neural policy's guard does not skip loss spikes (amax-loss's does); "
                "re-export it without spike_bits"
            )
    scale_time = p.get("scale_time", False)
    if not isinstance(scale_time, bool):
        raise PolicyError(
            f"policy '{manifest.name}' has scale_time {scale_time!r}, not true or false; re-export it"
        )
    if scale_time and guard is not None:
        raise PolicyError(
            f"policy '{manifest.name}' has both a guard and scale_time; a policy has one way to "
            "decide a step's scale from its loss: re-export it"
        )
    inputs = N_FEATURES * history + (N_SCALE_TIME if scale_time else 0)
    if not isinstance(p["layers"], list) or not p["layers"] or p["layers"][0] != inputs:
        now = f" + {N_SCALE_TIME} scale-time features" if scale_time else ""
        raise PolicyError(
            f"policy '{manifest.name}' expects layers starting at {inputs} inputs ({history} x the "
            f"extractor's {N_FEATURES} features{now}), the manifest has {p['layers']!r}; re-export it"
        )
    try:
        action = ActionMap.from_dict(p["action"])
    except (ConfigError, TypeError) as exc:
        raise PolicyError(
            f"policy '{manifest.name}' has an unreadable action map ({exc}); re-export it"
        ) from None
    if p["head"] == "argmax" and p["layers"][-1] != action.n:
        raise PolicyError(
            f"policy '{manifest.name}' picks among {p['layers'][-1]} actions, its action map has "
            f"{action.n}; re-export it"
        )
    blob, actor = load_weights(path, manifest, overrides, "neural")
    rule = NeuralPolicyRule(manifest=manifest, actor=actor, obs_norm=blob.get("obs_norm"))
    options = {k: p[k] for k in ("init_scale", "min_scale", "max_scale") if p.get(k) is not None}
    return LossScaler(rule, device, name=manifest.name, **{**options, **overrides})


def load_weights(
    path: Path, manifest: PolicyManifest, overrides: dict[str, Any], kind: str
) -> tuple[dict[str, Any], nn.Sequential]:
    """The checks and the load that every policy with a network shares: ``overrides`` are only
    the scaler's options, ``path/weights.pt`` is there and matches the manifest's checksum, and
    its actor fits ``parameters.layers`` and ``activation``. Returns (the weights file's blob,
    the actor).

    Raises:
        ConfigError: an override the policy does not take.
        PolicyError: missing, corrupt or mismatched weights.
    """
    unknown = sorted(set(overrides) - set(SCALER_OPTIONS))
    if unknown:
        raise ConfigError(
            f"scaler '{manifest.name}' (a {kind} policy) takes no parameter {unknown[0]!r}; "
            f"it takes: {', '.join(SCALER_OPTIONS)}"
        )
    weights = path / "weights.pt"
    if not weights.is_file():
        raise PolicyError(f"policy '{manifest.name}' has no weights.pt in '{path}'; re-export it")
    digest = sha256_file(weights)
    if manifest.weights_sha256 and digest != manifest.weights_sha256:
        raise PolicyError(
            f"policy '{manifest.name}': weights.pt checksum {digest[:12]}... does not match the "
            f"manifest's {manifest.weights_sha256[:12]}...; the file is corrupt or was replaced, "
            "re-export the policy"
        )
    try:
        blob = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise PolicyError(
            f"policy '{manifest.name}': cannot load weights.pt ({exc.__class__.__name__}); re-export it"
        ) from exc
    p = manifest.parameters
    actor = build_actor(list(p["layers"]), p["activation"])
    try:
        actor.load_state_dict(blob["actor"])
    except (KeyError, RuntimeError, TypeError) as exc:
        raise PolicyError(
            f"policy '{manifest.name}': weights do not fit the manifest's network ({exc}); re-export it"
        ) from exc
    return blob, actor


register_policy_kind("neural", load_neural)
