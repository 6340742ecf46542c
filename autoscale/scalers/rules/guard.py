"""The per-step loss guard's memory, shared by the rules and agents that guard each step.

Spiky losses make gradients whose size follows the loss (``amax-loss``'s docstring has the
measurements). :class:`LossGuard` keeps the largest gradient amax per unit of ``|loss|`` of the
last ``guard_history`` clean steps, and gives the limit a step's ``scale * |loss|`` must stay under
(:meth:`guard_limit`) to keep its foreseen amax ``guard_margin`` bits below fp16's maximum. A
scaler applies it on the device when the loss is scaled (no host sync); the environments apply
the host twin (:func:`~autoscale.scalers.loss_guard.guarded_scale`).

A loss that sums terms of both signs can sit near zero while its gradients do not (GRPO-style
RL fine-tuning: at the first optimizer step of each rollout the importance ratio is exactly 1 and
the loss is a mean of advantages normalised to zero, about 1e-8, with gradients of 1e-3;
``experiments/results/rl_finetune.md``). Such a step's amax per ``|loss|`` is about 10^5 and says
nothing of the next step's gradients, yet foresees an amax 10^5 too large at it. With
``guard_floor`` set, a step whose ``|loss|`` lies more than ``guard_floor`` bits below the largest
``|loss|`` of the last ``guard_history`` steps teaches the guard nothing, and remembered ratios
learned at such a loss do not count towards the limit; 0 (the default) keeps every one.

A finite loss far above the losses before it (a corrupt batch, a mislabelled shard) makes
gradients as far above theirs; the guard lowers that step's scale so that they fit fp16, and the
step is taken, where GradScaler's overflow would have dropped it (``experiments/results/
spike_harm.md``: under plain SGD without clipping such steps can diverge a run torch survives).
With ``spike_bits`` set, the guard also names such a step a spike and the scaler skips it: a step
whose ``|loss|`` is more than ``spike_bits`` bits above the largest ``|loss|`` of the last
``spike_memory`` steps it did not skip (:meth:`LossGuard.spike_limit`). Skipped spikes stay out
of that memory, so a spike does not hide the next. The way out: once ``spike_run`` spikes were
skipped among the last :data:`SPIKE_WINDOW` steps, the next is taken and its loss joins the
memory as its level. A loss that rises for good is taken after ``spike_run`` skips; so is a loss
that alternates with far smaller ones (GRPO-style fine-tuning, whose first step of each rollout
has a loss near zero: a memory of those alone would call every other step a spike, and a count
of spikes in a row never grows there, ``experiments/results/spike_cost.md``); spikes rarer than
``spike_run`` per window, the harmful kind, are each skipped. A spike teaches the guard nothing
and moves neither the scale nor the cap. 0 (the default): no step is skipped for its loss.
The step's mean loss decides (the losses scaled before its first optimizer step; with gradient
accumulation a spike in any micro-batch can make it one), as a record and its replays see the
step; the guard's scale is decided by the step's first loss, before its backward. Under
torch.distributed the test reads each rank's mean ``|loss|`` from the step's agreement, a spike
where any rank's passes (every rank skips alike), against a memory of the steps' mean losses
over the ranks: ranks whose losses differ by a factor ``r`` look up to ``log2(r)`` bits
higher.

``amax-loss`` hosts one; so can an agent: an environment given ``episode.guard`` applies it to
the agent's scales and learns it from every step, and the exported policy carries it, so the
agent sets the base scale and its growth while the guard takes each spike.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from autoscale.errors import ConfigError
from autoscale.scalers.controller import FP16_MAX, StepStats
from autoscale.scalers.rules.checks import check_bits, check_interval

__all__ = ["LEARNED", "SHORT", "SPIKE_WINDOW", "LossGuard"]

SHORT = "short"  # a guarded step overflowed all the same: the guard's foresight fell short
LEARNED = "learned"  # a clean step taught the guard its gradient amax per |loss|
SPIKE_WINDOW = 16  # steps over which spike_run counts the spikes skipped


class LossGuard:
    """The guard's memory and limit.

    Args:
        guard_history: Clean steps whose amax per ``|loss|`` it remembers.
        guard_margin: Bits the foreseen amax stays below fp16's maximum.
        guard_floor: Bits below the recent largest ``|loss|`` under which a step's loss is taken
            for a cancellation, not a size (the module's docstring); 0: never.
        spike_bits: Bits above the largest ``|loss|`` of the last ``spike_memory`` steps taken
            beyond which a step is a spike the scaler skips; 0: none is.
        spike_memory: Steps whose ``|loss|`` the spike test compares with.
        spike_run: Spikes skipped among the last :data:`SPIKE_WINDOW` steps after which the next
            is taken (a lasting rise, or a loss that alternates with far smaller ones).
    """

    has_guard = True
    _limit: float | None = None  # (class defaults: a guard pickled before the cache loads)
    _fresh = False  # the kept limit is of the memory as it is (False: compute it when read)
    _limit_cut = math.nan  # the cut the cached limit was computed with
    _top: float | None = None  # the largest ratio the cached limit counts
    _least = math.inf  # the least |loss| of the remembered ratios, with the kept limit
    spike_bits, spike_memory, spike_run = 0.0, 256, 2  # (a guard pickled before spikes: none)

    def __init__(
        self,
        guard_history: int = 16,
        guard_margin: float = 1.0,
        guard_floor: float = 0.0,
        spike_bits: float = 0.0,
        spike_memory: int = 256,
        spike_run: int = 2,
    ) -> None:
        self.guard_margin = check_bits("guard_margin", guard_margin)
        self.guard_history = check_interval("guard_history", guard_history)
        self.guard_floor = check_bits("guard_floor", guard_floor)
        self.spike_bits = check_bits("spike_bits", spike_bits)
        self.spike_memory = check_interval("spike_memory", spike_memory)
        self.spike_run = check_interval("spike_run", spike_run)
        if self.spike_run > SPIKE_WINDOW:  # the way out would never open
            raise ConfigError(
                f"spike_run must be at most {SPIKE_WINDOW} (spikes are counted over the last "
                f"{SPIKE_WINDOW} steps), got {spike_run}"
            )
        self.taken: deque[float] = deque(maxlen=self.spike_memory)  # |loss| of steps not skipped
        self.recent: deque[bool] = deque(maxlen=SPIKE_WINDOW)  # skipped as a spike, per step
        self.spikes = 0  # sum(recent): spikes skipped among the last SPIKE_WINDOW steps
        self._taken_max = 0.0  # max(taken), kept (NaN: compute it when read)
        self.ratios: deque[float] = deque(maxlen=self.guard_history)  # gradient amax per |loss|
        self.ratio_losses: deque[float] = deque(maxlen=self.guard_history)  # |loss| of each
        self.losses: deque[float] = deque(maxlen=self.guard_history)  # recent steps' |loss|
        # the limit, kept until the memory changes (the scaler reads it every step)
        self._limit: float | None = None
        self._fresh = False

    def _cut(self) -> float:
        """The ``|loss|`` below which a step teaches nothing (0: every one teaches)."""
        if not self.guard_floor or not self.losses:
            return 0.0
        return max(self.losses) * 2.0**-self.guard_floor

    def guard_limit(self) -> float | None:
        """The largest ``scale * |loss|`` a step may take (None before any clean step, or where
        the ``guard_floor`` leaves no remembered ratio)."""
        if not self._fresh:
            self._limit, self._top, self._limit_cut = self._computed()
            self._least = min(self.ratio_losses, default=math.inf)
            self._fresh = True
        return self._limit

    def spike_limit(self) -> float | None:
        """The ``|loss|`` above which the next step is a spike to skip, or None (no
        ``spike_bits``, nothing taken yet, or ``spike_run`` spikes skipped among the last
        :data:`SPIKE_WINDOW` steps)."""
        if not self.spike_bits or self.spikes >= self.spike_run or not self.taken:
            return None
        top = self._taken_max
        if top != top:
            top = self._taken_max = max(self.taken)
        return top * 2.0**self.spike_bits

    def _count(self, spiked: bool) -> None:
        """Count one step in the window of recent spikes."""
        if len(self.recent) == SPIKE_WINDOW:
            self.spikes -= self.recent[0]
        self.recent.append(spiked)
        self.spikes += spiked

    def _take(self, loss: float) -> None:
        """Remember the ``|loss|`` of a step not skipped as a spike."""
        if len(self.taken) == self.spike_memory and self.taken[0] == self._taken_max:
            self._taken_max = math.nan  # the largest leaves: read the memory again
        elif loss > self._taken_max:
            self._taken_max = loss
        self.taken.append(loss)

    def _computed(self) -> tuple[float | None, float | None, float]:
        """The limit from the whole memory, the largest ratio it counts, and the cut."""
        cut = self._cut()
        if not self.guard_floor:  # every lesson counts
            counted = self.ratios
        else:
            counted = [r for r, m in zip(self.ratios, self.ratio_losses) if m >= cut]
        top = max(counted) if counted else None
        return self._limit_of(top), top, cut

    def _limit_of(self, top: float | None) -> float | None:
        return FP16_MAX * 2.0**-self.guard_margin / top if top is not None else None

    def observe(self, scale: float, stats: StepStats) -> str | None:
        """Learn from one step taken at ``scale``: :data:`SHORT` when a guarded step overflowed
        (it remembers that this loss needed at least twice the room), :data:`LEARNED` when a
        clean step with a usable loss and amax taught it that step's amax per ``|loss|``, else
        None."""
        loss = abs(stats.loss) if stats.loss_seen else math.nan
        usable = 0.0 < loss < math.inf
        if self.spike_bits:
            self._count(stats.spiked)
        if stats.spiked:  # skipped for its loss: it teaches nothing
            return None
        if usable:
            self.losses.append(loss)
            if self.spike_bits:
                self._take(loss)
        # the limit depends on the losses only through the cut (none without a floor): most
        # steps leave it as it was, and the scaler reads it every step
        cut = self._cut()
        if self.guard_floor and cut != self._limit_cut and self._fresh:
            # a cut under the loss of every remembered ratio, before and after, counts them all
            # (a loss that falls step by step moves the cut on most steps): the same limit
            if max(cut, self._limit_cut) <= self._least:
                self._limit_cut = cut
            else:
                self._fresh = False
        if stats.found_inf or not math.isfinite(stats.grad_amax):
            if stats.guarded and usable:
                self._remember(2.0 * FP16_MAX / (scale * loss), loss)
                return SHORT
            return None
        if usable and stats.grad_amax > 0 and loss >= cut:
            self._remember(stats.grad_amax / loss, loss)
            return LEARNED
        return None

    def _remember(self, ratio: float, loss: float) -> None:
        if self._fresh:  # the kept limit follows one lesson in (and the oldest out)
            self._fresh = self._follow(ratio, loss)
        self.ratios.append(ratio)
        self.ratio_losses.append(loss)

    def _follow(self, ratio: float, loss: float) -> bool:
        """Bring the kept limit up to date for ``ratio`` learned at ``loss`` joining the memory
        (and a full memory's oldest ratio leaving it), at the kept cut, without reading the
        whole memory; False where that needs the whole memory (the largest counted ratio, or
        under a floor the least |loss|, leaves). The same limit as :meth:`_computed`, bit for
        bit: the same largest ratio."""
        cut, top = self._limit_cut, self._top
        if len(self.ratios) == self.guard_history and (
            (self.ratios[0] == top and (not self.guard_floor or self.ratio_losses[0] >= cut))
            or (self.guard_floor and self.ratio_losses[0] == self._least)
        ):
            return False
        if loss >= cut and (top is None or ratio > top):
            self._top, self._limit = ratio, self._limit_of(ratio)
        self._least = min(self._least, loss)
        return True

    def params(self) -> dict[str, Any]:
        return {
            "guard_history": self.guard_history,
            "guard_margin": self.guard_margin,
            "guard_floor": self.guard_floor,
            "spike_bits": self.spike_bits,
            "spike_memory": self.spike_memory,
            "spike_run": self.spike_run,
        }

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ratios": [float(r) for r in self.ratios],
            "ratio_losses": [float(m) for m in self.ratio_losses],
            "losses": [float(m) for m in self.losses],
        }
        if self.spike_bits:
            out.update(taken=[float(m) for m in self.taken], recent=[int(x) for x in self.recent])
        return out

    def load_state(self, state: dict[str, Any], owner: str) -> None:
        """Restore :meth:`state`; ``owner`` names the rule or policy in errors."""
        ratios = _positives(state, "ratios", [], owner, inf=False)
        # a checkpoint from before guard_floor: its ratios count whatever their loss
        ratio_losses = _positives(state, "ratio_losses", [math.inf] * len(ratios), owner)
        if len(ratio_losses) != len(ratios):
            raise ConfigError(
                f"{owner}: state 'ratio_losses' must hold one |loss| per ratio, got "
                f"{len(ratio_losses)} for {len(ratios)}; the checkpoint was not written by this rule"
            )
        self.ratios = deque(ratios, maxlen=self.guard_history)
        self.ratio_losses = deque(ratio_losses, maxlen=self.guard_history)
        losses = _positives(state, "losses", [], owner, inf=False)
        self.losses = deque(losses, maxlen=self.guard_history)
        self._fresh = False
        if self.spike_bits:
            self.taken = deque(_positives(state, "taken", [], owner, inf=False), self.spike_memory)
            self._taken_max = math.nan
            recent = state.get("recent", [])
            if not isinstance(recent, list) or not all(
                x in (0, 1) and not isinstance(x, float) for x in recent
            ):
                raise ConfigError(
                    f"{owner}: state 'recent' must be a list of 0 and 1 (a step skipped as a "
                    f"spike or not), got {recent!r}; the checkpoint was not written by this rule"
                )
            self.recent = deque(map(bool, recent), maxlen=SPIKE_WINDOW)
            self.spikes = sum(self.recent)


def _positives(
    state: dict[str, Any], key: str, default: list[float], owner: str, inf: bool = True
) -> list[float]:
    """``state[key]``: a list of positive numbers (inf among them only where ``inf``)."""
    values = state.get(key, default)
    if not isinstance(values, list) or not all(
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and v > 0
        and (v < math.inf or (inf and v == math.inf))
        for v in values
    ):
        raise ConfigError(
            f"{owner}: state '{key}' must be a list of positive numbers, got "
            f"{values!r}; the checkpoint was not written by this rule"
        )
    return [float(v) for v in values]
