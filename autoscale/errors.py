"""The exceptions autoscale raises on user input, and how the CLI shows them.

Each message states the rule, the value that broke it and the fix, so the CLI can print it as one
line and exit with status 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "AutoscaleError",
    "UnknownNameError",
    "ConfigError",
    "PolicyError",
    "BudgetError",
    "StorageError",
    "MinimumLossScaleError",
    "MissingExtraError",
    "TorchVersionError",
    "EXTRA_OF_MODULE",
    "missing_extra",
    "unknown_name",
    "check_keys",
]


class AutoscaleError(Exception):
    """Base of every error autoscale raises on purpose; the CLI prints it as one line."""


class UnknownNameError(AutoscaleError, KeyError):
    """A name (scaler, model, scenario, algorithm, study, instance) that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ConfigError(AutoscaleError, ValueError):
    """A value or file that does not satisfy its rule (bad parameter, unreadable YAML, bad path)."""


class PolicyError(AutoscaleError):
    """An exported policy that is missing, corrupt, or incompatible with this version."""


class BudgetError(ConfigError):
    """A malformed wall-clock budget."""


class StorageError(AutoscaleError):
    """An Optuna storage that cannot be reached or opened."""


class MinimumLossScaleError(AutoscaleError, RuntimeError):
    """Raised when a scaler asked to behave like DeepSpeed hits its minimum scale on an overflow."""


class MissingExtraError(AutoscaleError, ImportError):
    """A command needs an optional extra (``pip install 'autoscale[NAME]'``) that is not installed."""


class TorchVersionError(AutoscaleError, ImportError):
    """The installed torch lacks a private member that autoscale's scaler or instruments rely on."""


#: The top-level modules each optional extra of pyproject installs, so that a command whose module
#: is missing can name the extra to install. The base install (torch, NumPy, PyYAML, tqdm,
#: matplotlib) runs the scalers, ``wrap`` and ``report``, and ``run``, ``compare`` and ``doctor`` on
#: the models that are not Hugging Face's; ``autoscale.integrations`` names its frameworks' extra too.
EXTRA_OF_MODULE: dict[str, str] = {
    "optuna": "search",
    "optuna_dashboard": "search",
    "gymnasium": "search",
    "stable_baselines3": "search",
    "transformers": "hf",
    "accelerate": "integrations",
    "lightning": "integrations",
}


def missing_extra(what: str, module: str) -> MissingExtraError | None:
    """The error for ``what`` (e.g. ``"autoscale search"``) when ``module`` is not installed.

    Args:
        what: What needed the module, as the user called it.
        module: The missing module's name (a dotted name counts by its top level).

    Returns:
        The error naming the extra that installs ``module``, or None when no extra does (then the
        missing module is not an optional part of autoscale, and the caller lets the import error
        stand).
    """
    top = module.split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return MissingExtraError(
        f"{what} needs the '{extra}' extra ({top} is not installed): "
        f"pip install 'autoscale[{extra}]'"
    )


def unknown_name(kind: str, name: str, known: Iterable[str], how_to_list: str) -> UnknownNameError:
    """Build the standard 'unknown X; did you mean Y?' error.

    Args:
        kind: What was looked up, e.g. ``"scaler"``.
        name: The name the user gave.
        known: Every valid name.
        how_to_list: Where the user sees all names, e.g. ``"autoscale list"``.
    """
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not close and len(name) >= 3:  # a name cut short: the one it begins, where one is
        close = [k for k in known if k.startswith(name)]
    hint = f"; did you mean '{close[0]}'?" if len(close) == 1 else ""
    return UnknownNameError(
        f"unknown {kind} '{name}'{hint} ({how_to_list} shows all: {', '.join(known)})"
    )


def check_keys(
    where: str,
    data: Iterable[str],
    allowed: Iterable[str],
    elsewhere: dict[str, Iterable[str]] | None = None,
) -> None:
    """Raise ConfigError for the first key of ``data`` not in ``allowed``, suggesting the nearest,
    or the section the key belongs to.

    Args:
        where: What holds the keys, e.g. ``"envs/x.yaml: episode"``.
        data: The keys given (a mapping works).
        allowed: The valid keys.
        elsewhere: The keys of the sections nested in this one, by section: a key of one of
            them is said to belong there.
    """
    allowed = list(allowed)
    for key in data:
        if key in allowed:
            continue
        section = next((s for s, keys in (elsewhere or {}).items() if key in keys), None)
        if section is not None:
            hint = f"; it belongs under '{section}:'"
        else:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{where}: unknown key '{key}'{hint} (allowed: {', '.join(allowed)})")
