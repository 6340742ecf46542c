"""The manifest of an exported policy (``policies/NAME/policy.yaml``): read, validate, write.

Torch and PyYAML only, so that loading a policy at training time needs nothing else.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autoscale.errors import PolicyError

__all__ = ["PolicyManifest", "read_manifest", "write_manifest", "sha256_file", "MANIFEST_FORMAT"]

MANIFEST_FORMAT = 1
KINDS = ("parametric", "neural")


@dataclass(frozen=True)
class PolicyManifest:
    """What an exported policy is and where it came from.

    Attributes:
        name: The policy's registry name (its folder name).
        kind: ``"parametric"`` (a rule with tuned knobs) or ``"neural"`` (a network in ``weights.pt``).
        family: The rule id for a parametric policy; the network architecture for a neural one.
        parameters: Rule keyword arguments, or the network's shape and action mapping.
        feature_version: Version of the feature spec a neural policy reads (None for rules).
        autoscale_version: autoscale's version at export.
        torch_version: torch's version at export.
        workload: What it was searched or trained on (model, scenario, dtype, ...).
        scorecard: Its scorecard on that workload's held-out instances.
        weights_sha256: Checksum of ``weights.pt`` (neural only).
        format: Manifest format version.
    """

    name: str
    kind: str
    family: str
    parameters: dict[str, Any] = field(default_factory=dict)
    feature_version: int | None = None
    autoscale_version: str = ""
    torch_version: str = ""
    workload: dict[str, Any] = field(default_factory=dict)
    scorecard: dict[str, Any] = field(default_factory=dict)
    weights_sha256: str | None = None
    format: int = MANIFEST_FORMAT

    def describe(self) -> str:
        what = f"{self.kind} policy ({self.family})"
        wl = self.workload
        if wl:
            what += (" trained on " if self.kind == "neural" else " searched on ") + "/".join(
                str(wl[k]) for k in ("model", "scenario") if k in wl
            )
        return what

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_manifest(path: str | os.PathLike) -> PolicyManifest:
    """Read and validate ``path/policy.yaml``.

    Raises:
        PolicyError: missing, unreadable or malformed manifest, or a newer format.
    """
    folder = Path(path)
    file = folder / "policy.yaml"
    if not file.is_file():
        raise PolicyError(
            f"no policy.yaml in '{folder}'; export a policy there with 'autoscale export'"
        )
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PolicyError(
            f"cannot read '{file}': {str(exc).splitlines()[0]}; re-export the policy"
        ) from exc
    if not isinstance(data, dict):
        raise PolicyError(f"'{file}' is not a mapping; re-export the policy")
    known = set(PolicyManifest.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise PolicyError(
            f"'{file}' has unknown keys {unknown}; it was written by a newer autoscale, upgrade it"
        )
    for key in ("name", "kind", "family"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise PolicyError(f"'{file}' lacks '{key}'; re-export the policy")
    if data["kind"] not in KINDS:
        raise PolicyError(f"'{file}' has kind '{data['kind']}', expected one of {KINDS}")
    if int(data.get("format", MANIFEST_FORMAT)) > MANIFEST_FORMAT:
        raise PolicyError(
            f"'{file}' uses manifest format {data['format']}, this autoscale reads up to {MANIFEST_FORMAT}; upgrade autoscale"
        )
    for key in ("parameters", "workload", "scorecard"):
        if data.get(key) is None:
            data[key] = {}
        if not isinstance(data[key], dict):
            raise PolicyError(f"'{file}': '{key}' must be a mapping")
    return PolicyManifest(**data)


def write_manifest(path: str | os.PathLike, manifest: PolicyManifest) -> Path:
    """Write ``path/policy.yaml`` atomically (a reader never sees half a file)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(_plain(manifest.to_dict()), sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".policy.", suffix=".yaml")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, folder / "policy.yaml")
    return folder / "policy.yaml"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _plain(obj: Any) -> Any:
    """Turn numpy scalars and tuples into YAML-safe primitives."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, str):
        return str(obj)  # str subclasses such as torch's TorchVersion
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj
