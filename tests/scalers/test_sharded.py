"""The sharded scaler in one process (its training on two ranks: tests/integrations/test_fsdp.py),
and the import hook that replaces FSDP's ShardedGradScaler under ``autoscale wrap``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import autoscale
from autoscale.errors import ConfigError
from autoscale.observe.on_import import when_imported
from autoscale.scalers import LossScaler, TorchRule
from autoscale.scalers.sharded import ShardedLossScaler, as_sharded, sharded_scaler


def test_a_sharded_scaler_is_both_and_keeps_its_rule():
    scaler = sharded_scaler("deepspeed", "cpu", init_scale=2.0**10, loss_scale_window=50)
    assert isinstance(scaler, ShardedGradScaler) and isinstance(scaler, LossScaler)
    assert type(scaler) is ShardedLossScaler
    assert scaler.name == "deepspeed" and scaler.rule.params()["loss_scale_window"] == 50
    assert scaler.get_scale() == 2.0**10 and scaler.process_group is None


def test_a_float16_loss_is_scaled_in_float16_as_sharded_grad_scaler_does():
    """GradScaler multiplies a 0-dim float16 loss by its float32 scale into float32;
    ShardedGradScaler casts the product back to float16, where 1.5 * 2^16 overflows."""
    loss = torch.tensor(1.5, dtype=torch.float16)
    plain = autoscale.get_scaler("torch", "cpu").scale(loss)
    sharded = sharded_scaler("torch", "cpu").scale(loss)
    theirs = ShardedGradScaler("cpu").scale(loss)
    assert plain.dtype is torch.float32 and plain.item() == 1.5 * 2.0**16
    assert sharded.dtype is theirs.dtype is torch.float16
    assert sharded.item() == theirs.item() == float("inf")
    batch = [torch.ones(2, dtype=torch.float16), torch.ones(2)]  # and an iterable of tensors
    assert [t.dtype for t in sharded_scaler("torch", "cpu").scale(batch)] == [
        torch.float16,
        torch.float32,
    ]


def test_as_sharded_keeps_the_scaler_and_refuses_what_it_cannot_keep():
    scaler = autoscale.get_scaler("amax-history", "cpu", init_scale=2.0**7)
    assert as_sharded(scaler) is scaler and isinstance(scaler, ShardedGradScaler)
    assert scaler.get_scale() == 2.0**7 and as_sharded(scaler) is scaler

    class Mine(LossScaler):
        pass

    with pytest.raises(ConfigError, match="as_sharded takes a LossScaler, got a Mine"):
        as_sharded(Mine(TorchRule(), "cpu"))
    with pytest.raises(ConfigError, match="identical_grads=True does not hold for sharded"):
        sharded_scaler("torch", "cpu", identical_grads=True)


@pytest.fixture
def module_on_path(tmp_path, monkeypatch):
    name = "autoscale_hook_probe"
    (tmp_path / f"{name}.py").write_text(
        "import autoscale_hook_probe_env as env\nSEEN = env.value\nclass Thing:\n    pass\n"
    )
    env = type(sys)("autoscale_hook_probe_env")
    env.value = "as imported"
    monkeypatch.setitem(sys.modules, env.__name__, env)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, env
    sys.modules.pop(name, None)
    sys.meta_path[:] = [
        f for f in sys.meta_path if type(f).__module__ != "autoscale.observe.on_import"
    ]


def test_when_imported_runs_after_the_import_not_a_lookup(module_on_path):
    name, env = module_on_path
    calls = []

    @contextlib.contextmanager
    def during():
        env.value = "during"
        yield
        env.value = "after"

    when_imported(name, lambda m: calls.append((m.SEEN, m.__name__)), during=during)
    assert importlib.util.find_spec(name) is not None  # a lookup: nothing runs, the hook stays
    assert calls == []
    module = importlib.import_module(name)
    assert calls == [("during", name)]  # the module's code ran inside during(), then the call
    assert env.value == "after" and module.__loader__.__class__.__name__ != "_Loader"
    importlib.reload(module)  # once only: the hook left
    assert len(calls) == 1
    when_imported(name, lambda m: calls.append("now"))  # imported already: at once
    assert calls[-1] == "now"
