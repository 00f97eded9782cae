#!/usr/bin/env bash
# Our offline throughput before and after a change, side by side on one machine:
#
#   git worktree add /tmp/base <commit>          # the tree to compare against
#   bash bench/ab_offline.sh /tmp/base 2 --shape lfm2-350m --workloads a,b
#
# Runs `bench/offline.py --vs none ARGS` from BASE_TREE and from this tree, alternating
# (base, new, base, new, ...) ROUNDS times, so load that drifts during the run hits both sides.
# Each process writes the same random checkpoint (same --seed). Prints every SUMMARY line and,
# per workload, the median tokens/s of each side and new/base (> 1: the change is faster).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=$(cd "$1" && pwd)
ROUNDS=$2
shift 2
PY="${PYTHON:-.venv/bin/python}"
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute: one interpreter for both trees
LOG=$(mktemp)
for round in $(seq "$ROUNDS"); do
  for side in base new; do
    tree=$([ "$side" = base ] && echo "$BASE" || pwd)
    echo "== round $round $side ($(git -C "$tree" rev-parse --short HEAD))"
    # NOTE: the run's output goes to a file and is printed after; `tee /dev/stderr` would
    # reopen (and truncate) a redirected log.
    (cd "$tree" && PYTHONPATH="$tree" "$PY" bench/offline.py --vs none "$@") >"$LOG.run" 2>&1
    grep -v "it/s]" "$LOG.run" || true
    sed -n "s/^SUMMARY offline /$side /p" "$LOG.run" >>"$LOG"
  done
done
"$PY" - "$LOG" <<'PYEOF'
import re, statistics, sys
rows: dict[tuple[str, str], dict[str, list[float]]] = {}
for line in open(sys.argv[1]):
    side, rest = line.split(" ", 1)
    f = dict(re.findall(r"(\w+)=(\S+)", rest))
    rows.setdefault((f["shape"], f["workload"]), {}).setdefault(side, []).append(
        float(f["ours_tok_s"])
    )
print("| shape | workload | base tok/s (runs) | new tok/s (runs) | new/base (medians) |")
print("|---|---|---|---|---|")
for (shape, wl), by in rows.items():
    b, n = statistics.median(by["base"]), statistics.median(by["new"])
    runs = lambda xs: " ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    print(f"| {shape} | {wl} | {b:.1f} ({runs(by['base'])}) | {n:.1f} ({runs(by['new'])}) "
          f"| {n / b:.3f} |")
PYEOF
