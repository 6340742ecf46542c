"""Batches and the task losses: next-token prediction on real text, or a fixed Gaussian mixture.

A :class:`BatchStream` draws training batches by a cursor (batch ``i`` is a pure function of the
seed and ``i``, so a snapshot only needs the cursor), keeps a fixed set of held-out batches drawn
from a disjoint part of the data, and knows the task's losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from autoscale.errors import ConfigError

__all__ = [
    "BatchStream",
    "TokenStream",
    "MixtureStream",
    "load_text",
    "check_data",
    "byte_tokens",
    "EVAL_FRACTION",
]

EVAL_FRACTION = 0.1  # the tail of the text held out for evaluation, never trained on


def load_text(path: str | None) -> str:
    """The text of ``path`` (a file, or every file under a folder, in sorted order).

    None gives CPython's ``pydoc_data.topics`` (the interpreter's help pages, ~465 KB of English
    prose and code), which is on every Python installation, so nothing is downloaded.
    """
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics))
    p = _data_path(path)
    try:
        if p.is_dir():
            files = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)
            )
            text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
        else:
            text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(
            f"cannot read data '{path}': {exc.strerror or exc}; give a readable text file or folder"
        ) from exc
    if not text.strip():
        raise ConfigError(
            f"data '{path}' holds no text; give a text file or a folder of text files"
        )
    return text


def _data_path(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(
            f"data path '{path}' does not exist; give a text file or a folder of text files"
        )
    return p


def check_data(model: str, data: str | None) -> None:
    """Refuse, before anything is built, a ``--data`` path the model does not read (only a
    language model reads text; ``mlp``, ``autoencoder`` and a user's workload make their own
    batches) or one that does not exist.

    Raises:
        ConfigError: naming the path and the fix.
    """
    from autoscale.training.presets import PRESETS, is_user_workload

    if data is None:
        return
    preset = PRESETS.get(model)
    if is_user_workload(model) or (preset is not None and preset.kind != "lm"):
        lms = ", ".join(name for name, p in PRESETS.items() if p.kind == "lm")
        raise ConfigError(
            f"--data '{data}': model '{model}' makes its own batches and reads no data; drop "
            f"--data, or train a language model on it ({lms}, a Hub id or a local folder)"
        )
    _data_path(data)


def byte_tokens(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids in [0, 256)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class BatchStream:
    """Training batches by cursor, fixed held-out batches, and the task's losses.

    Args:
        batch_size: Rows per batch.
        seed: Seeds the order of training batches (held-out batches do not depend on it).
        eval_batches: Number of held-out batches.
        device: Where batches are put.
    """

    def __init__(
        self, *, batch_size: int, seed: int, eval_batches: int, device: torch.device
    ) -> None:
        self.batch_size = batch_size
        self.seed = seed
        self.n_eval_batches = eval_batches
        self.device = device
        self.cursor = 0
        self._eval: list[Any] | None = None

    def next_batch(self) -> Any:
        """The next training batch (advances the cursor)."""
        gen = torch.Generator().manual_seed((self.seed * 0x9E3779B1 + self.cursor) % 2**63)
        self.cursor += 1
        return self._train_batch(gen)

    def _train_batch(self, gen: torch.Generator) -> Any:
        raise NotImplementedError

    def eval_batches(self) -> list[Any]:
        """The fixed held-out batches (built once, on the device)."""
        if self._eval is None:
            self._eval = self._eval_batches()
        return self._eval

    def _eval_batches(self) -> list[Any]:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy of the batch (a scalar float32 tensor)."""
        raise NotImplementedError

    def preference_logprobs(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row mean log-probability of the batch and of a dispreferred counterpart."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])


class TokenStream(BatchStream):
    """Windows of ``seq_len + 1`` tokens of one long token sequence, for causal LMs.

    The last :data:`EVAL_FRACTION` of the tokens (at least one window) is held out; held-out
    batches are evenly spaced windows there. The dispreferred counterpart of a window (for the
    preference scenario) is the same window reversed.
    """

    def __init__(
        self, tokens: torch.Tensor, *, seq_len: int, vocab_size: int, source: str, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.seq_len = seq_len
        window = seq_len + 1
        n = tokens.numel()
        n_eval = max(window, int(n * EVAL_FRACTION))
        if n - n_eval < window:
            raise ConfigError(
                f"data {source} has {n} tokens; seq_len {seq_len} needs at least {window + n_eval} "
                f"(one training and one held-out window); use more text or a smaller --seq-len"
            )
        top = int(tokens.max())
        if top >= vocab_size:
            raise ConfigError(
                f"data {source} has token id {top}, beyond the model's vocabulary of {vocab_size}"
            )
        self.train_tokens = tokens[: n - n_eval]
        self.eval_tokens = tokens[n - n_eval :]
        self._offsets = torch.arange(window)

    def _train_batch(self, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(
            0, self.train_tokens.numel() - self.seq_len, (self.batch_size,), generator=gen
        )
        return self.train_tokens[starts[:, None] + self._offsets].to(self.device, non_blocking=True)

    def _eval_batches(self) -> list[torch.Tensor]:
        count = self.n_eval_batches * self.batch_size
        starts = torch.linspace(0, self.eval_tokens.numel() - self.seq_len - 1, count).long()
        windows = self.eval_tokens[starts[:, None] + self._offsets].to(self.device)
        return list(windows.split(self.batch_size))

    def loss(self, model, batch):
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def preference_logprobs(self, model, batch):
        both = torch.cat([batch, batch.flip(1)])
        logits = model(input_ids=both[:, :-1], use_cache=False).logits
        logp = logits.float().log_softmax(-1).gather(-1, both[:, 1:, None]).squeeze(-1).mean(-1)
        return logp[: len(batch)], logp[len(batch) :]


class MixtureStream(BatchStream):
    """A fixed Gaussian-mixture classification set, for the ``mlp`` preset.

    ``classes`` means drawn from N(0, I) in ``features`` dimensions; each example is its class
    mean plus N(0, I) noise, so classes overlap and the loss does not reach zero. The data set is
    the same on every machine and for every spec seed (generator seed 1234): ``n_train`` training
    and ``n_eval`` held-out examples. The dispreferred counterpart of an example (preference
    scenario) is the same input with the next class as its label.
    """

    DATA_SEED = 1234

    def __init__(
        self,
        *,
        features: int = 32,
        classes: int = 10,
        n_train: int = 16384,
        n_eval: int = 2048,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.classes = classes
        gen = torch.Generator().manual_seed(self.DATA_SEED)
        means = torch.randn(classes, features, generator=gen)
        labels = torch.randint(0, classes, (n_train + n_eval,), generator=gen)
        inputs = means[labels] + torch.randn(n_train + n_eval, features, generator=gen)
        self.train_x, self.eval_x = inputs[:n_train], inputs[n_train:]
        self.train_y, self.eval_y = labels[:n_train], labels[n_train:]

    def _train_batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.train_x), (self.batch_size,), generator=gen)
        return self.train_x[idx].to(self.device, non_blocking=True), self.train_y[idx].to(
            self.device, non_blocking=True
        )

    def _eval_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for i in range(self.n_eval_batches):
            idx = torch.arange(i * self.batch_size, (i + 1) * self.batch_size) % len(self.eval_x)
            out.append((self.eval_x[idx].to(self.device), self.eval_y[idx].to(self.device)))
        return out

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    def preference_logprobs(self, model, batch):
        x, y = batch
        logp = model(x).float().log_softmax(-1)
        return logp.gather(-1, y[:, None]).squeeze(-1), logp.gather(
            -1, ((y + 1) % self.classes)[:, None]
        ).squeeze(-1)


class LowRankStream(BatchStream):
    """A fixed low-rank vector data set, for the ``autoencoder`` preset (no labels, no text).

    Each example is ``A z + 0.1 noise`` with ``z`` ~ N(0, I) in ``rank`` dimensions and a fixed
    ``A`` (``features`` x ``rank``, generator seed 4321), so an autoencoder with a ``rank``-wide
    code can reconstruct it up to the noise. The loss is the mean squared reconstruction error;
    the "log-probability" of an example (preference scenario) is minus its per-example squared
    error, and its dispreferred counterpart is the reconstruction measured against the example's
    features reversed, which a good model gets wrong.
    """

    DATA_SEED = 4321

    def __init__(
        self,
        *,
        features: int = 64,
        rank: int = 8,
        n_train: int = 16384,
        n_eval: int = 2048,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        gen = torch.Generator().manual_seed(self.DATA_SEED)
        basis = torch.randn(features, rank, generator=gen) / rank**0.5
        codes = torch.randn(n_train + n_eval, rank, generator=gen)
        data = codes @ basis.T + 0.1 * torch.randn(n_train + n_eval, features, generator=gen)
        self.train_x, self.eval_x = data[:n_train], data[n_train:]

    def _train_batch(self, gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, len(self.train_x), (self.batch_size,), generator=gen)
        return self.train_x[idx].to(self.device, non_blocking=True)

    def _eval_batches(self) -> list[torch.Tensor]:
        out = []
        for i in range(self.n_eval_batches):
            idx = torch.arange(i * self.batch_size, (i + 1) * self.batch_size) % len(self.eval_x)
            out.append(self.eval_x[idx].to(self.device))
        return out

    def loss(self, model, batch):
        return F.mse_loss(model(batch).float(), batch)

    def preference_logprobs(self, model, batch):
        recon = model(batch).float()
        return -(recon - batch).square().mean(-1), -(recon - batch.flip(-1)).square().mean(-1)
