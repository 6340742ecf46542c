#!/usr/bin/env bash
# The GPU tier on a CUDA machine, in under 8 minutes on one H200:
#   1. tests/gpu (parity with GradScaler on CUDA fp16, fused AdamW with inf and NaN, host syncs,
#      device-to-host reads, the environment and a search step on GPT-2 124M);
#   2. experiments/gpu/bench.py: rule and instrumented-step overheads, env step, with CUDA events;
#   3. experiments/benchmarks/search_budget.py on GPT-2 124M (share of the budget used, bookkeeping).
# Writes experiments/results/gpu.md (and copies it to $OUT when that is set). Packages the machine
# lacks come from .whl/ (experiments/gpu/wheels.sh downloads them where there is internet).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
RESULT=experiments/results/gpu.md
T0=$(date +%s)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/autoscale-site .whl/*.whl \
    && export PYTHONPATH="/tmp/autoscale-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
LOG=$(mktemp -d)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$LOG/gpu.txt" 2>&1
timeout 240 "$PY" -m pytest -q -m cuda tests/gpu -p no:cacheprovider --durations=10 > "$LOG/tests.txt" 2>&1
TESTS_RC=$?
timeout 150 "$PY" experiments/gpu/bench.py --out "$LOG/bench.md" > "$LOG/bench.txt" 2>&1
BENCH_RC=$?
( cd "$LOG" && timeout 300 "$PY" "$OLDPWD/experiments/benchmarks/search_budget.py" \
    --model gpt2 --budget 4m --quiet ) > "$LOG/search.txt" 2>&1
SEARCH_RC=$?

{
  echo "# The GPU tier"
  echo
  echo "\`bash experiments/gpu/check.sh\` on $(cat "$LOG/gpu.txt"), $(date -u +%Y-%m-%d), $(( $(date +%s) - T0 )) s in all."
  echo
  echo "## tests/gpu (exit $TESTS_RC)"
  echo '```'; tail -25 "$LOG/tests.txt"; echo '```'
  echo
  echo "## Overheads, timed with CUDA events (exit $BENCH_RC)"
  echo
  if [ -f "$LOG/bench.md" ]; then cat "$LOG/bench.md"; else echo '```'; tail -25 "$LOG/bench.txt"; echo '```'; fi
  echo
  echo "## autoscale search --model gpt2 --budget 4m (exit $SEARCH_RC)"
  echo '```'; tail -30 "$LOG/search.txt"; echo '```'
} > "$RESULT"
[ -n "${OUT:-}" ] && cp "$RESULT" "$OUT/gpu.md"
cat "$RESULT"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ] && [ "$SEARCH_RC" = 0 ]
