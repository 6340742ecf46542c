"""``autoscale train-agent``."""

from __future__ import annotations

import argparse
from pathlib import Path

from autoscale.commands.base import POLICY_DIR_HELP, Command


class TrainAgentCommand(Command):
    """Train a Stable-Baselines3 agent to set the loss scale, and export the best one."""

    epilog = """examples:
  autoscale record --env envs/bad-batches.yaml --steps 256 --out traces/bad-batches.npz
  autoscale train-agent --env envs/bad-batches.yaml --algo ppo --replay traces/bad-batches.npz \\
      --timesteps 50000 --out ppo-bad-batches
  autoscale eval --policy ppo-bad-batches --env envs/bad-batches.yaml --seeds 3
  autoscale train-agent --env envs/bad-batches.yaml --replay traces/bad-batches.npz --guard \
      --out ppo-guarded    # the agent sets the base scale, amax-loss's guard takes the spikes
  autoscale train-agent --env envs/bad-batches.yaml --replay traces/bad-batches.npz \
      --scale-time --out ppo-scale-time    # the agent sees each step's loss and takes spikes
  autoscale train-agent --env envs/bad-batches.yaml --replay traces/bad-batches.npz \
      --residual --out res-bad-batches    # an offset on auto's scale, trained to the bar

algorithms: ppo, a2c (discrete or continuous actions), dqn (discrete), sac (continuous)

The checkpoint kept is the best on each member's last train instance, held out of training, so
the test instances autoscale eval reports on stay unseen; a spec with a single train instance
keeps the last model (no checkpoint selection), and says so.
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--env", required=True, help="env spec: a YAML path or a name in envs/")
        parser.add_argument("--algo", default="ppo", help="ppo, a2c, dqn or sac (default ppo)")
        parser.add_argument(
            "--timesteps", type=int, default=20000, help="environment steps to train for"
        )
        parser.add_argument(
            "--replay",
            metavar="TRACE",
            help="train (and evaluate) on this recorded trace, not real steps",
        )
        parser.add_argument(
            "--out",
            metavar="NAME",
            required=True,
            help="export the kept model as DIR/NAME (see --policy-dir)",
        )
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--guard",
            action="store_true",
            help="act under amax-loss's per-step loss guard (episode.guard with its defaults, "
            "unless the spec sets one): the agent sets the base scale, the guard takes each "
            "spike, and the exported policy keeps the guard",
        )
        parser.add_argument(
            "--scale-time",
            action="store_true",
            help="act when the loss is scaled, seeing this step's loss (episode.scale_time); "
            "discrete actions also get drops of 4, 8, 12 and 16 bits for one step, unless the "
            "spec gives action.drops. The exported policy decides in the scaler the same way",
        )
        parser.add_argument(
            "--residual",
            action="store_true",
            help="a residual agent on auto: an offset of -4..+4 bits on auto's scale, chosen "
            "every --window steps, auto's guard and backoff kept, trained to the bar against "
            "torch's replay of the same episodes (needs --replay; --timesteps counts decisions)",
        )
        parser.add_argument(
            "--window", type=int, help="steps a residual agent's offset holds (default 16)"
        )
        parser.add_argument(
            "--eval-freq",
            type=int,
            default=None,
            help="evaluate on the held-out train instance every N steps (selects the checkpoint)",
        )
        parser.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard logs here")
        parser.add_argument("--policy-dir", metavar="DIR", help=POLICY_DIR_HELP)
        parser.add_argument(
            "--force", action="store_true", help="overwrite an existing policy of that name"
        )
        parser.add_argument("--quiet", action="store_true", help="no progress bar")

    def run(self, args: argparse.Namespace) -> int:
        import dataclasses

        from autoscale.agents.train import train_agent
        from autoscale.commands.run import check_output
        from autoscale.envs.spec import GuardSpec, load_env_spec
        from autoscale.errors import ConfigError
        from autoscale.scalers.policies import default_policy_dir, policy_ref

        # the agent is exported once trained: a folder it cannot go to fails now
        check_output(args.policy_dir or str(default_policy_dir()), "--policy-dir", folder=True)
        check_output(args.tensorboard, "--tensorboard", folder=True)
        for flag, value in (("--window", args.window), ("--eval-freq", args.eval_freq)):
            if value is not None and value <= 0:
                raise ConfigError(f"{flag} must be a positive number of steps, got {value}")
        if args.window is not None and not args.residual:
            raise ConfigError("--window sets a residual agent's offset: add --residual or drop it")
        if args.replay and not Path(args.replay).exists():  # (a suite's traces: a folder)
            from autoscale.envs.suite import load_spec
            from autoscale.envs.traces import missing_trace

            load_spec(args.env)  # an --env that is no spec is said first
            raise missing_trace(args.replay, args.env)
        env = args.env
        if args.residual:
            return _residual(args)
        if args.guard and args.scale_time:
            raise ConfigError(
                "--guard and --scale-time both decide a step's scale from its loss; give one"
            )
        if args.scale_time:
            env = load_env_spec(args.env)
            env = dataclasses.replace(env, episode=env.episode.at_scale_time())
        if args.guard:
            env = load_env_spec(args.env)
            if env.episode.guard is None:
                episode = dataclasses.replace(env.episode, guard=GuardSpec())
                env = dataclasses.replace(env, episode=episode)
        result = train_agent(
            env,
            args.algo,
            args.timesteps,
            replay=args.replay,
            seed=args.seed,
            eval_freq=args.eval_freq,
            tensorboard=args.tensorboard,
            progress=not args.quiet,
            export_name=args.out,
            export_dir=args.policy_dir,
            force=args.force,
            hold_out=True,
        )
        trained = f"trained {result.algo} for {result.timesteps} steps in {result.wall_s:.1f} s"
        if result.selected_on:
            print(
                f"{trained}; checkpoint selected on the held-out train instance(s) "
                f"{', '.join(result.selected_on)} (mean reward {result.best_eval_reward:.3f}); "
                "the test instances stay unseen for autoscale eval"
            )
        else:
            print(
                f"{trained}; no checkpoint selection: a member has a single train instance, all "
                "of it trained on, so the last model is kept (the test instances stay unseen)"
            )
        print(
            f"exported {result.policy_dir}; use it with autoscale.get_scaler('{policy_ref(result.policy_dir)}')"
        )
        return 0


def _residual(args: argparse.Namespace) -> int:
    """``--residual``: train a residual agent on auto (autoscale.agents.residual)."""
    from autoscale.agents.residual import train_residual
    from autoscale.agents.train import held_out
    from autoscale.envs.suite import load_spec
    from autoscale.errors import ConfigError
    from autoscale.scalers.policies import policy_ref

    if args.guard or args.scale_time:
        raise ConfigError(
            "--residual keeps auto's own guard and acts after the step: drop --guard/--scale-time"
        )
    if not args.replay:
        raise ConfigError("--residual trains on replay: give --replay TRACE (autoscale record)")
    spec = load_spec(args.env)
    selecting, window = held_out(spec), args.window or 16
    result = train_residual(
        selecting or spec, args.algo, args.timesteps, replay=args.replay,
        select_on="test" if selecting is not None else None, window=window, seed=args.seed,
        eval_freq=args.eval_freq, progress=not args.quiet, export_name=args.out,
        export_dir=args.policy_dir, force=args.force,
    )  # fmt: skip
    last = result.multipliers[-20:]
    over = sum(v[0] for v in last) / len(last) if last else 0.0
    print(
        f"trained a residual {result.algo} agent on auto for {result.timesteps} decisions of "
        f"{window} steps in {result.wall_s:.1f} s; "
        + (
            f"selected on the held-out train instance(s) (mean reward {result.best_eval_reward:.3f})"
            if selecting is not None
            else "no checkpoint selection (a single train instance): the last model is kept"
        )
        + f"; its last {len(last)} training episodes skipped {over:+.2%} of steps beyond torch's "
        "+ 0.5 points (the bar; below 0 meets it)"
    )
    print(
        f"exported {result.policy_dir}; use it with autoscale.get_scaler('{policy_ref(result.policy_dir)}')"
    )
    return 0
