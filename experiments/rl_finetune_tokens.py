"""How the rl-finetune loss's gradients shrink with the tokens sampled per step.

The loss averages advantage-weighted log-probability ratios over every sampled token, and the
advantages are centred within each group, so the per-token gradients mostly cancel: the mean's
size should fall as 1 / sqrt(tokens). This takes the first 8 steps of gpt2-tiny on rl-finetune
(weight 1, lr 1e-4, seeds 0 and 1) at 4, 16 and 64 prompts per step (4 completions of 12 tokens
each) and prints the mean gradient RMS and amax the scaler's statistics measured (unscaled).
What a real RL batch of N tokens would give is then extrapolated from the fit, which is what
``envs/rl-finetune.yaml``'s ``weight`` stands for.

    python experiments/rl_finetune_tokens.py
"""

from __future__ import annotations

import statistics

import torch

from autoscale.training import TrainingRun, WorkloadSpec


def main() -> None:
    torch.set_num_threads(1)
    for batch_size in (4, 16, 64):
        rms, amax = [], []
        for seed in (0, 1):
            spec = WorkloadSpec(
                model="gpt2-tiny",
                scenario="rl-finetune",
                seq_len=16,
                lr=1e-4,
                batch_size=batch_size,
                seed=seed,
            )
            run = TrainingRun(spec, "torch")
            for _ in range(8):
                record = run.step()
                rms.append(record.grad_rms)
                amax.append(record.grad_amax)
        tokens = batch_size * 4 * 12
        print(
            f"batch_size {batch_size:3d} tokens/step {tokens:5d} "
            f"grad_rms {statistics.mean(rms):.3e} grad_amax {statistics.mean(amax):.3e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
