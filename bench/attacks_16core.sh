#!/usr/bin/env bash
# The index's attack benchmark on a host of 16 cores (no GPU used), in one go,
# from the project root:
#
#   bash bench/attacks_16core.sh OUT_DIR [MORE FLAGS OF bench/index_attacks.py]
#
# Runs every attack of bench/index_attacks.py right after its own baseline
# (--alternate), 4 s measured each, with 200 honest clients behind 127.0.0.1,
# the attackers from 127.0.0.2 (another peer; the *_same_address attacks from
# 127.0.0.1 on purpose), the index, the attacker, the honest fleet and the
# normal client each on a core of its own (--pin-cores), the normal client's
# heartbeats 1 ms apart ($HEARTBEAT_MS: 4,000 samples for each p99, not the
# 350 of the 10 ms default, whose p99 is a few samples' worst), then plots it:
#
#   OUT_DIR/attacks.json   the figures (rewritten after every scenario)
#   OUT_DIR/attacks.txt    the table as printed (a line per scenario)
#   OUT_DIR/attacks.png    heartbeat p99 / its baseline, index RSS over time
#
# With ROUNDS=N (default 1) it runs N times, into OUT_DIR/round-K/ each, and
# then prints the verdict of bench/attack_rounds.py: each attack's median over
# the rounds of its p99 / own baseline p99 (a noisy host moves one round's
# baseline p99 by 3x; give --only a few attacks to keep the rounds short).
#
# About 5 minutes on 16 cores; within 9 in all: the benchmark starts no attack
# that would end past 480 s (--time-budget; those left are listed as skipped),
# and each step has a hard time limit. Flags after OUT_DIR are passed on (the
# last of a flag wins), e.g. `--seconds 1 --only pin_flood reserve_flood` for
# a quick check.
#
# Needs Linux and python3 (3.10 or later; $PYTHON to use another) with numpy,
# msgpack, prometheus_client and sortedcontainers (what the index imports;
# nothing else beyond the standard library), and matplotlib for the plot
# (without it the plot is skipped: run bench/plot_index_attacks.py
# elsewhere). A package that is not installed may be put in bench/.site/
# (git ignores it): sortedcontainers and prometheus_client are pure Python.
set -u
out=${1:?usage: bash bench/attacks_16core.sh OUT_DIR [FLAGS of bench/index_attacks.py]}
shift
python=${PYTHON:-python3}
started=$(date +%s)
say() { echo "[$(( $(date +%s) - started )) s] $*"; }

mkdir -p "$out" || exit 2
# The index and the clients are single-threaded: no BLAS threads per process.
export PYTHONUNBUFFERED=1 PYTHONPATH=core:bench/.site OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

say "checking $python and what the index and the benchmark import"
if ! "$python" - 2>&1 <<'PY'
import importlib, sys
if sys.version_info < (3, 10):
    sys.exit(f"python {sys.version.split()[0]}: the index needs 3.10 or later (set PYTHON)")
if not sys.platform.startswith("linux"):
    sys.exit("the benchmark reads /proc and binds 127.0.0.2: it runs on Linux only")
missing = []
for module, package in [("numpy", "numpy"), ("msgpack", "msgpack"), ("prometheus_client", "prometheus-client"),
                        ("sortedcontainers", "sortedcontainers")]:
    try:
        importlib.import_module(module)
    except ImportError:
        missing.append(package)
if missing:
    sys.exit(f"missing: {', '.join(missing)}. Install them, or put a copy of each (pure Python ones) in "
             f"bench/.site/ (on PYTHONPATH here)")
import maru_core.index.service, maru_core.cli  # the index itself, and what it imports
sys.path.insert(0, "bench")
import index_attacks  # the benchmark and its attacks
print(f"python {sys.version.split()[0]}, {len(__import__('os').sched_getaffinity(0))} CPUs usable, "
      f"pinned as {index_attacks.core_plan()}")
PY
then
    say "cannot run: see the line above (nothing was measured)"
    exit 2
fi
plot=1
if ! "$python" -c "import matplotlib" 2>/dev/null; then
    say "no matplotlib: the plot will be skipped (bench/plot_index_attacks.py OUT_DIR/attacks.json OUT.png elsewhere)"
    plot=0
fi

run_once() {  # $1: where its figures go; the rest: flags for the benchmark
    local dir=$1 status
    shift
    mkdir -p "$dir" || return 2
    timeout -k 10 510 "$python" bench/index_attacks.py --seconds 4 --alternate --pin-cores --honest-clients 200 \
        --heartbeat-ms "${HEARTBEAT_MS:-1}" --time-budget 480 --out "$dir/attacks.json" "$@" 2>&1 | tee "$dir/attacks.txt"
    status=${PIPESTATUS[0]}
    if [ "$status" -ne 0 ]; then
        say "the benchmark failed (exit $status); what it measured is in $dir/attacks.json"
    fi
    if [ "$plot" = 1 ] && [ -s "$dir/attacks.json" ]; then
        say "plot"
        timeout 60 "$python" bench/plot_index_attacks.py "$dir/attacks.json" "$dir/attacks.png" || status=1
    fi
    return "$status"
}

say "benchmark: a line per scenario as it ends (columns: see bench/index_attacks.py)"
status=0
rounds=${ROUNDS:-1}
if [ "$rounds" -le 1 ]; then
    run_once "$out" "$@" || status=$?
else
    for k in $(seq "$rounds"); do
        say "round $k of $rounds"
        run_once "$out/round-$k" "$@" || status=$?
    done
    "$python" bench/attack_rounds.py "$out"/round-*/attacks.json | tee "$out/verdict.txt" || status=1
fi
say "done (exit $status): $out"
exit "$status"
