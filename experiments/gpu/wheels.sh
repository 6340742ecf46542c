#!/usr/bin/env bash
# Download, on a machine with internet, the wheels that check.sh needs and a GPU image may lack
# (the GPU machines reach no package index): Optuna and its dashboard, Gymnasium,
# Stable-Baselines3 and what they pull that such images do not hold. Into .whl/ at the repository
# root (ignored by git), for Python 3.12 on x86-64 Linux; check.sh installs them offline.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_VERSION="${PY_VERSION:-3.12}"
mkdir -p .whl
for spec in optuna optuna-dashboard gymnasium stable-baselines3 sqlalchemy alembic mako colorlog \
            farama-notifications greenlet bottle; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls .whl
