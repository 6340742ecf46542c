import math

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import autoscale.envs  # noqa: F401  (registers the env ids)
from autoscale.envs import LossScaleEnv, ReplayEnv, Trace, load_env_spec
from autoscale.envs.episodes import drive_episode, scaler_for
from autoscale.errors import ConfigError, UnknownNameError
from autoscale.scalers.features import N_FEATURES


def test_registered_ids_make_both_envs(tiny_spec, tiny_trace):
    env = gym.make("autoscale.envs:autoscale/LossScale-v0", spec=tiny_spec)
    assert env.spec.nondeterministic
    obs, info = env.reset(seed=0)
    assert obs.shape == (N_FEATURES,) and info["scale"] == 65536
    replay = gym.make("autoscale/LossScaleReplay-v0", spec=tiny_spec, trace=str(tiny_trace))
    assert replay.spec.nondeterministic
    assert replay.reset(seed=0)[0].shape == (N_FEATURES,)


def test_env_checkers_pass(tiny_spec, tiny_trace):
    for env in (LossScaleEnv(tiny_spec), ReplayEnv(tiny_spec, tiny_trace)):
        check_env(env, skip_render_check=True)
        sb3_check_env(env, warn=False)


def test_continuous_actions(tiny_spec, tiny_trace):
    spec = {
        **tiny_spec.to_dict(),
        "episode": {
            **tiny_spec.to_dict()["episode"],
            "action": {"mode": "continuous", "max_delta": 2},
        },
    }
    env = ReplayEnv(spec, tiny_trace)
    check_env(env, skip_render_check=True)
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([0.5], dtype=np.float32))  # +1 bit
    assert info["scale"] == 2.0**17


def test_seeded_resets_reproduce_first_observations(tiny_spec):
    env = LossScaleEnv(tiny_spec)
    firsts = []
    for _ in range(2):
        obs, info = env.reset(seed=123)
        steps = [env.step(3)[0] for _ in range(3)]
        firsts.append((info["instance"], obs, steps))
    assert firsts[0][0] == firsts[1][0]
    np.testing.assert_array_equal(firsts[0][1], firsts[1][1])
    for a, b in zip(firsts[0][2], firsts[1][2]):
        np.testing.assert_array_equal(a, b)
    # a warmed-up start point (start=3) starts with a non-trivial history
    obs, _ = env.reset(options={"instance": "train-s1-t3"})
    assert obs[10] > 0  # progress feature: steps seen during warm-up


def test_episode_truncates_and_reward_scores_skips(tiny_spec):
    env = LossScaleEnv(tiny_spec)
    env.reset(options={"instance": "train-s0-t0"})
    rewards, skipped = [], []
    for t in range(tiny_spec.episode.steps):
        _, r, terminated, truncated, info = env.step(2)  # keep the scale
        rewards.append(r)
        skipped.append(info["skipped"])
        assert not terminated
        assert truncated == (t == tiny_spec.episode.steps - 1)
    # every 4th step carries an inf loss: skipped at any scale, and charged the skip weight
    assert skipped == [False, False, False, True] * 2
    assert all(r <= -1.0 for r, s in zip(rewards, skipped) if s)
    assert all(r > -1.0 for r, s in zip(rewards, skipped) if not s)


def test_rule_through_env_matches_autoscale_run(tiny_spec):
    from autoscale.training import TrainingRun

    env = LossScaleEnv(tiny_spec, instances="test")
    card, _ = drive_episode(env, scaler_for("torch", tiny_spec, growth_interval=2), "test-s5-t0")
    run = TrainingRun(
        tiny_spec.workload.replace(seed=5),
        "torch",
        init_scale=65536,
        min_scale=1.0,
        max_scale=2**30,
        growth_interval=2,
    )
    ref = run.run(tiny_spec.episode.steps)
    a, b = card.to_dict(), ref.to_dict()
    for key in ("wall_s", "useful_steps_per_s"):
        a.pop(key), b.pop(key)
    assert a == b
    assert (
        card.skipped == 2 and card.max_scale > card.min_scale
    )  # growth after 2 clean steps happened


def test_bad_instance_names_and_sets(tiny_spec):
    with pytest.raises(
        UnknownNameError, match="unknown instance 'train-s0-t1'; did you mean 'train-s0-t0'"
    ):
        LossScaleEnv(tiny_spec, instances=["train-s0-t1"])
    env = LossScaleEnv(tiny_spec)
    with pytest.raises(UnknownNameError, match="unknown instance 'nope'"):
        env.reset(options={"instance": "nope"})


def test_replay_reproduces_recorded_overflows(tiny_spec, tiny_trace):
    trace = Trace.load(tiny_trace)
    t = trace.instance("train-s0-t0")
    assert t.steps == 16 and t.nonfinite.tolist() == [False, False, False, True] * 4
    env = ReplayEnv(tiny_spec, trace)
    env.reset(options={"instance": "train-s0-t0"})
    # at the recorded scales nothing but the bad batches overflows
    skipped = [env.step_at(float(t.scale[i]))[4]["skipped"] for i in range(8)]
    assert skipped == t.nonfinite[:8].tolist()
    # two bits above the threshold every step overflows
    env.reset(options={"instance": "train-s0-t0"})
    assert all(env.step_at(2.0 ** (t.threshold[i] + 2))[4]["skipped"] for i in range(8))


def test_replay_precision_matches_scorecard_definition(tiny_spec, tiny_trace):
    from autoscale.training import precision_loss_from_hist

    trace = Trace.load(tiny_trace)
    t = trace.instance("test-s5-t0")
    env = ReplayEnv(tiny_spec, trace, instances="test")
    env.reset(options={"instance": "test-s5-t0"})
    for i, log2s in enumerate([4, 6.5, 10, 3, -2, 8, 12, 1]):
        *_, info = env.step_at(2.0**log2s)
        if not info["skipped"]:
            expected = precision_loss_from_hist(t.hist[i].tolist(), math.log2(info["scale"]))
            assert info["precision_loss"] == pytest.approx(expected, abs=1e-9)


def test_trace_version_and_workload_are_checked(tiny_spec, tiny_trace, tmp_path):
    import json

    data = dict(np.load(tiny_trace))
    meta = json.loads(str(data["meta"]))
    meta["version"] = 99
    data["meta"] = np.array(json.dumps(meta))
    bad = tmp_path / "old.npz"
    np.savez(bad, **data)
    with pytest.raises(
        ConfigError, match="version 99, this autoscale reads version 2; record it again"
    ):
        Trace.load(bad)
    with pytest.raises(ConfigError, match="no trace file"):
        Trace.load(tmp_path / "missing.npz")
    other = {**tiny_spec.to_dict(), "workload": {**tiny_spec.workload.to_dict(), "seq_len": 32}}
    with pytest.raises(ConfigError, match="record a trace for this spec"):
        ReplayEnv(other, tiny_trace)


def test_replay_starts_instances_where_the_real_env_does(tiny_spec, tiny_trace):
    """An instance with warm-up steps starts at the same scale and features in both envs."""
    real = LossScaleEnv(tiny_spec)
    replay = ReplayEnv(tiny_spec, tiny_trace)
    for name in ("train-s0-t0", "train-s1-t3"):
        obs_real, info_real = real.reset(options={"instance": name})
        obs_replay, info_replay = replay.reset(options={"instance": name})
        assert info_real["scale"] == info_replay["scale"]
        np.testing.assert_array_equal(obs_real, obs_replay)
    assert obs_real[10] > 0  # the warm-up steps are in the features (progress), in both


def _preference_spec(steps: int):
    """The mlp's preference workload (a DPO-style loss, beta 50): spiky losses."""
    return load_env_spec(
        {
            "name": "spiky",
            "workload": {
                "model": "mlp",
                "scenario": "preference",
                "scenario_params": {"beta": 50},
                "dtype": "fp16",
            },  # fmt: skip
            "episode": {
                "steps": steps,
                "init_scale": 65536,
                "min_scale": 1.0,
                "max_scale": 2**40,
            },  # fmt: skip
            "instances": {"train": [{"seed": 0}], "test": [{"seed": 3}]},
        }
    )


def test_a_guarding_rule_through_env_matches_autoscale_run():
    """amax-loss lowers the scale of single steps from their loss: the real env applies the same
    guard the scaler does (same scales, same skips, same guarded steps), and replay applies it
    from the recorded loss."""
    from autoscale.training import TrainingRun

    spec = _preference_spec(48)
    env = LossScaleEnv(spec, instances="test")
    card, records = drive_episode(env, scaler_for("amax-loss", spec), "test-s3-t0")
    run = TrainingRun(
        spec.workload.replace(seed=3), "amax-loss", init_scale=65536, min_scale=1.0,
        max_scale=2**40,
    )  # fmt: skip
    ref = run.run(spec.episode.steps)

    def key(r):  # (statistics NaN on skipped steps compare unequal to themselves)
        return (r.scale, r.found_inf, r.stats.guarded, r.loss, r.precision_loss)

    assert [key(r) for r in records] == [key(r) for r in run.records]
    assert card.skip_rate == ref.skip_rate and card.precision_loss == ref.precision_loss
    guarded = [r.step for r in records if r.stats.guarded]
    assert guarded, "no step's loss called for a lower scale: the test shows nothing"
    assert all(r.scale < 65536 for r in records if r.stats.guarded)
    env.set_guard(None)  # an agent's steps are its own
    assert env.guard_rule is None


def test_a_guard_that_skips_spikes_through_env_matches_autoscale_run_and_replay(tmp_path):
    """amax-loss with spike_bits skips steps whose loss jumps above the losses it took: the real
    env skips the steps the scaler skips, and the replay env (and the report's replay) skip the
    steps whose recorded loss jumps so, leaving the scale where it was."""
    from autoscale.envs import record_trace
    from autoscale.training import TrainingRun

    spec = _preference_spec(64)
    # this run's losses jump 0.8 bits over the largest before them, twice early on: spikes here
    kw = {"spike_bits": 0.5, "spike_run": 3}
    env = LossScaleEnv(spec, instances="test")
    card, records = drive_episode(env, scaler_for("amax-loss", spec, **kw), "test-s3-t0")
    run = TrainingRun(
        spec.workload.replace(seed=3), "amax-loss", init_scale=65536, min_scale=1.0,
        max_scale=2**40, **kw,
    )  # fmt: skip
    run.run(spec.episode.steps)

    def key(r):
        return (r.scale, r.found_inf, r.stats.spiked, r.loss, r.precision_loss)

    assert [key(r) for r in records] == [key(r) for r in run.records]
    spiked = [r.step for r in records if r.stats.spiked]
    assert spiked, "no loss jumped half a bit: the test shows nothing"
    assert all(r.found_inf and math.isfinite(r.loss) for r in records if r.stats.spiked)

    # replayed from a trace: each spiked step is one whose loss is over 2^0.5 times the largest
    # the rule took among the last 256 (spike_run 3: fewer than three skipped among the last 16
    # steps), and no other is
    path = tmp_path / "spiky.npz"
    record_trace(spec, 64, path)
    replay = ReplayEnv(spec, path, instances="test")
    _, replayed = drive_episode(replay, scaler_for("amax-loss", spec, **kw), "test-s3-t0")
    taken, want = [], []
    for r in replayed:
        m = abs(r.loss)
        room = sum(want[-16:]) < 3
        spike = bool(taken) and room and 2.0**0.5 * max(taken[-256:]) < m < math.inf
        want.append(spike)
        if not spike and 0 < m < math.inf:
            taken.append(m)
    assert [r.stats.spiked for r in replayed] == want and any(want)
    assert all(r.found_inf and math.isnan(r.precision_loss) for r in replayed if r.stats.spiked)
