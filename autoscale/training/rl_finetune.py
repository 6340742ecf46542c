"""The ``rl-finetune`` scenario: GRPO-style reinforcement-learning fine-tuning of a causal LM.

Since 2025 several RL fine-tuning frameworks train language models in fp16 again (fp16's 10
mantissa bits keep the trainer's and the sampler's log-probabilities closer than bf16's 7),
under a GradScaler whose ``growth_interval`` is set by hand. Their loss is unlike pre-training's:
an advantage-weighted importance ratio averaged over many sampled tokens, whose value sits near
zero (advantages are centred within each group) and whose gradients are small, with rare large
ratios once the policy has moved away from the one that sampled. This module reproduces that
loop on the workload's language model, with the data's text as prompts and a reward the model
can learn to raise, so every command (``run``, ``compare``, ``search``, the suite, the
environments) can train on it.

One round, every ``inner_steps`` optimizer steps and per micro-batch:

1. Rollout (no gradient, under the run's autocast, so in the same precision as the trainer):
   the first ``prompt_len`` tokens of each window of the batch are a prompt; the model samples
   ``group`` completions of ``completion_len`` tokens per prompt at ``temperature``, from a
   generator seeded by the seed and the round (so a run is a function of its seed, and a
   snapshot holds the round's tensors). A second forward over the whole sequences gives the
   sampling policy's per-token log-probabilities, as the frameworks recompute them in the
   trainer; the frozen reference's ones too when ``kl > 0``.
2. Reward: the fraction of a completion's tokens whose id lies in ``[target_lo, target_hi)``
   (lowercase ASCII letters in the byte vocabulary of the presets; a slice of a Hugging Face
   model's vocabulary otherwise). It is cheap, and a policy raises it by moving probability
   mass, which is what the gradient has to carry.
3. Advantages: rewards normalised within each group, ``(r - mean) / (std + 1e-4)``.

Each step then trains on the round's rollout: per completion token, ``-min(ratio * A,
clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)`` with ``ratio = exp(logp - logp_sampling)``, plus
``kl`` times the k3 estimate of the KL to the reference, averaged over all tokens. At the first
step of a round the trainer's log-probabilities are the sampler's, so the ratio is exactly 1;
the later steps of the round are off-policy, which is where clipping (and the large ratios of
negative-advantage tokens, which the clip does not bound) comes in. Dropout is switched off in
the model, as those frameworks do, so that the ratio measures the policy's change only.

The held-out loss is ``1 - `` the expected reward of the policy on held-out prompts: at each
position of completions sampled with a fixed generator, the probability mass the policy puts on
the rewarded tokens, averaged (lower is better, like every loss).
"""

from __future__ import annotations

from typing import Any

import torch

from autoscale.errors import ConfigError
from autoscale.training.data import TokenStream
from autoscale.training.scenarios import Scenario, register_scenario

__all__ = ["RLFinetune", "group_advantages", "token_reward"]

STD_EPS = 1e-4  # added to each group's reward std before dividing (as GRPO implementations do)
_EVAL_SEED = 0x5EED  # the held-out completions' generator: the same for every evaluation


def token_reward(completions: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Per row of ``completions`` (token ids), the fraction of tokens with id in ``[lo, hi)``."""
    return ((completions >= lo) & (completions < hi)).float().mean(-1)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Rewards normalised within consecutive groups of ``group`` rows: ``(r - mean) / (std +
    1e-4)``; a group whose rewards are all equal gets zero advantages (it carries no signal)."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(-1, keepdim=True)
    std = grouped.std(-1, keepdim=True)
    return ((grouped - mean) / (std + STD_EPS)).view(-1)


@register_scenario("rl-finetune")
class RLFinetune(Scenario):
    """GRPO-style RL fine-tuning: a clipped importance ratio times group-normalised advantages.

    Reproduces: the fp16 RL fine-tuning loop of language models (see the module's docstring for
    the algorithm). The loss is an average over many sampled tokens of advantage-weighted ratios,
    centred near zero, so gradients are small (underflow at a low scale), while the off-policy
    steps of a round bring rare large ratios (overflow at a high one).

    Parameters: ``group`` (int, 4: completions per prompt), ``prompt_len`` (int, 16),
    ``completion_len`` (int, 12), ``temperature`` (float, 1.0), ``clip_eps`` (float, 0.2),
    ``kl`` (float, 0.0: coefficient of the KL to the frozen initial model), ``inner_steps`` (int,
    2: optimizer steps per rollout), ``target_lo``/``target_hi`` (int, 97/123: the rewarded
    token ids), ``weight`` (float, 1.0: weight on the loss, for the token counts of large
    batches).
    """

    description = "GRPO-style RL fine-tuning: clipped ratio x group advantage over sampled tokens"
    defaults = {
        "group": 4,
        "prompt_len": 16,
        "completion_len": 12,
        "temperature": 1.0,
        "clip_eps": 0.2,
        "kl": 0.0,
        "inner_steps": 2,
        "target_lo": 97,
        "target_hi": 123,
        "weight": 1.0,
    }

    def __init__(self, seed: int = 0, **params: Any) -> None:
        super().__init__(seed, **params)
        self._rollouts: dict[int, dict[str, Any]] = {}  # per micro-batch: the current round's
        self._ref_state: dict[str, torch.Tensor] | None = None  # the frozen reference's weights
        self._ref_model: torch.nn.Module | None = None  # built from them when needed
        self.last: dict[str, torch.Tensor] = {}  # the last objective's ratio, advantages, rewards

    @classmethod
    def validate(cls, params):
        p = params
        if p["group"] < 2:
            raise ConfigError(
                f"scenario 'rl-finetune' needs group >= 2 (advantages are normalised within a "
                f"group), got {p['group']}"
            )
        for key in ("prompt_len", "completion_len", "inner_steps"):
            if p[key] < 1:
                raise ConfigError(f"scenario 'rl-finetune' needs {key} >= 1, got {p[key]}")
        if not 0 < p["clip_eps"] < 1 or p["temperature"] <= 0 or p["weight"] <= 0:
            raise ConfigError(
                f"scenario 'rl-finetune' needs 0 < clip_eps < 1, temperature > 0 and weight > 0; "
                f"got {p['clip_eps']}, {p['temperature']}, {p['weight']}"
            )
        if p["kl"] < 0:
            raise ConfigError(f"scenario 'rl-finetune' needs kl >= 0, got {p['kl']}")
        if not 0 <= p["target_lo"] < p["target_hi"]:
            raise ConfigError(
                f"scenario 'rl-finetune' needs 0 <= target_lo < target_hi, got "
                f"{p['target_lo']}, {p['target_hi']}"
            )

    def loss_weight(self, step: int) -> float:
        return self.params["weight"]

    # ------------------------------------------------------------------ the loss
    def objective(self, data, model, batch, step, micro):
        self._check(data, batch)
        _no_dropout(model)
        p = self.params
        round_ = step // p["inner_steps"]
        rollout = self._rollouts.get(micro)
        if rollout is None or rollout["round"] != round_:
            rollout = self._rollout(model, batch, round_, micro)
            self._rollouts[micro] = rollout
        tokens, adv = rollout["tokens"], rollout["advantages"][:, None]
        logp = self._logprobs(model, tokens)
        ratio = torch.exp(logp - rollout["old_logp"])
        clipped = ratio.clamp(1.0 - p["clip_eps"], 1.0 + p["clip_eps"])
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        if p["kl"] > 0:
            delta = rollout["ref_logp"] - logp  # k3: exp(d) - d - 1 >= 0, unbiased for KL
            per_token = per_token + p["kl"] * (torch.exp(delta) - delta - 1.0)
        self.last = {
            "ratio": ratio.detach(),
            "advantages": rollout["advantages"],
            "rewards": rollout["rewards"],
        }
        return per_token.mean()

    def eval_objective(self, data, model, batch):
        self._check(data, batch)
        p = self.params
        gen = torch.Generator(device=batch.device).manual_seed(_EVAL_SEED)
        tokens = self._sample(model, batch, gen)
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits[:, -p["completion_len"] :]
        probs = torch.softmax(logits.float() / p["temperature"], -1)
        lo, hi = p["target_lo"], min(p["target_hi"], probs.shape[-1])
        return 1.0 - probs[..., lo:hi].sum(-1).mean()

    # ------------------------------------------------------------------ rollouts
    def _check(self, data: Any, batch: Any) -> None:
        if not isinstance(data, TokenStream):
            raise ConfigError(
                "scenario 'rl-finetune' samples text from a causal language model; use a "
                "language-model preset (gpt2-tiny...) or a Hugging Face model, not this workload"
            )
        if self.params["prompt_len"] > batch.shape[1]:
            raise ConfigError(
                f"scenario 'rl-finetune': prompt_len {self.params['prompt_len']} is longer than "
                f"the data's windows of {batch.shape[1]} tokens; raise --seq-len or lower prompt_len"
            )

    def _rollout(
        self, model: torch.nn.Module, batch: torch.Tensor, round_: int, micro: int
    ) -> dict[str, Any]:
        """Sample the round's completions and score them, without gradient."""
        p = self.params
        seed = (self.seed * 0x9E3779B1 + round_ * 0x85EBCA77 + micro * 0xC2B2AE3D) % 2**63
        gen = torch.Generator(device=batch.device).manual_seed(seed)
        with torch.no_grad():
            tokens = self._sample(model, batch, gen)
            old_logp = self._logprobs(model, tokens)
            ref_logp = None
            if p["kl"] > 0:
                ref_logp = self._logprobs(self._reference(model), tokens)
        rewards = token_reward(tokens[:, -p["completion_len"] :], p["target_lo"], p["target_hi"])
        return {
            "round": round_,
            "tokens": tokens,
            "old_logp": old_logp,
            "ref_logp": ref_logp,
            "rewards": rewards,
            "advantages": group_advantages(rewards, p["group"]),
        }

    def _sample(
        self, model: torch.nn.Module, batch: torch.Tensor, gen: torch.Generator
    ) -> torch.Tensor:
        """Prompts (each repeated ``group`` times) followed by sampled completions."""
        p = self.params
        tokens = batch[:, : p["prompt_len"]].repeat_interleave(p["group"], 0)
        with torch.no_grad():
            for _ in range(p["completion_len"]):
                logits = model(input_ids=tokens, use_cache=False).logits[:, -1]
                probs = torch.softmax(logits.float() / p["temperature"], -1)
                tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen)], 1)
        return tokens

    def _logprobs(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Per completion token, its log-probability under ``model`` (at the temperature)."""
        n = self.params["completion_len"]
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits[:, -n:]
        logp = torch.log_softmax(logits.float() / self.params["temperature"], -1)
        return logp.gather(-1, tokens[:, -n:, None]).squeeze(-1)

    def _reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference: the model as it was at the first rollout."""
        if self._ref_state is None:
            self._ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if self._ref_model is None:
            import copy

            self._ref_model = copy.deepcopy(model).requires_grad_(False)
            self._ref_model.load_state_dict(self._ref_state)
        return self._ref_model

    # ------------------------------------------------------------------ snapshots
    def state_dict(self) -> dict[str, Any]:
        """The current round's rollouts (per micro-batch) and the reference's weights."""
        return {"rollouts": dict(self._rollouts), "reference": self._ref_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rollouts = dict(state.get("rollouts") or {})
        self._ref_state = state.get("reference")
        self._ref_model = None
        self.last = {}


def _no_dropout(model: torch.nn.Module) -> None:
    """Switch dropout off (RL fine-tuning frameworks do): the ratio then measures only how far
    the policy moved, and is exactly 1 at the first step of a round."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p != 0.0:
            module.p = 0.0
