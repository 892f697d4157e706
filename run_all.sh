#!/usr/bin/env bash
# Install (first call only), train a profile into runs/<profile>/, analyse it, compare it with the
# committed reference results/<profile>/.
#   ./run_all.sh                                  # quick profile: every method a few steps on CPU, memory and time by phase (minutes)
#   ./run_all.sh --profile cpu                    # the CPU reproduction (hours; rerun to resume after a stop)
#   ./run_all.sh --profile tiny                   # the same paths on tiny-llama in about a minute (tests/test_run_all.py)
#   ./run_all.sh --profile paper --launcher slurm launcher.partition=gpu launcher.account=me
#   ./run_all.sh --profile paper --dry-run        # list the paper jobs and their planned memory per GPU
#   ./run_all.sh --profile cpu --publish [--partial]   # maintainers: copy the finished runs/cpu into results/cpu
# Other arguments go to `python -m experiments.launch` (launcher.<key>=..., root=..., key=value run overrides).
# This run: runs/<profile>/ (git-ignored; root= moves it) with runs/<name>-<hash8>/, memory/, summary.csv,
# tables/, figures/. The reference: results/<profile>/, written only by --publish (python -m experiments.publish).
set -euo pipefail
cd "$(dirname "$0")"
profile=quick launcher="" dry_run=0 publish=0 rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --profile=*) profile="${1#*=}"; shift ;;
    --launcher) launcher="$2"; shift 2 ;;
    --launcher=*) launcher="${1#*=}"; shift ;;
    --dry-run|-n) dry_run=1; shift ;;
    --publish) publish=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) rest+=("$1"); shift ;;
  esac
done
if [ ! -f "experiments/sweeps/$profile.yaml" ]; then  # quick | cpu | paper, or any other sweep there (tiny: the tests')
  echo "unknown profile '$profile' (quick | cpu | paper; the sweeps are experiments/sweeps/*.yaml)" >&2; exit 2
fi
root="runs/$profile" reference="results/$profile"
for a in ${rest[@]+"${rest[@]}"}; do case "$a" in root=*) root="${a#root=}" ;; esac; done
if [ "$profile" = paper ] && [ "$launcher" != slurm ] && [ "$dry_run" = 0 ] && [ "$publish" = 0 ]; then
  cat >&2 <<'MSG'
The paper profile trains 1.5B-27B models on 8-GPU nodes: it runs on a SLURM cluster, not here.
  check it:   ./run_all.sh --profile paper --dry-run
  submit it:  ./run_all.sh --profile paper --launcher slurm launcher.partition=<partition> launcher.account=<account>
MSG
  exit 2
fi
source scripts/bootstrap.sh
# GSM8K/MATH-500 come from LOGRA_DATA_DIR; default to ../shared/data beside the repo when present.
if [ -z "${LOGRA_DATA_DIR:-}" ] && [ -d ../shared/data ]; then export LOGRA_DATA_DIR="$(cd ../shared/data && pwd)"; fi
case "$(python -c 'import os, sys; print(os.path.realpath(sys.argv[1]))' "$root")/" in "$(pwd -P)/results/"*)
  echo "root=$root is inside results/, the committed references: train elsewhere (default runs/$profile), then --publish" >&2
  exit 2 ;;
esac
if [ "$publish" = 1 ]; then
  exec python -m experiments.publish "sweep=$profile" ${rest[@]+"${rest[@]}"} "root=$root" "to=$reference"
fi
args=("sweep=$profile")
[ -n "$launcher" ] && args+=("launcher=$launcher")
[ "$dry_run" = 1 ] && args+=(--dry-run)
status=0
python -m experiments.launch "${args[@]}" ${rest[@]+"${rest[@]}"} "root=$root" || status=$?
[ "$dry_run" = 1 ] && exit $status
# The analysis step: tables and figures of every run under the root (<root>/tables, <root>/figures).
python -m analysis "$root" || status=$?
# This run's headline tables beside the reference's, with the difference.
echo
python -m analysis.compare "$root" "$reference" || status=$?
if [ -f "$root/tables/time_step.md" ]; then  # python -m experiments.time_table, rendered by the analysis step
  echo; echo "time table by phase ($root/tables/time_step.md; figure $root/time/time.png):"; cat "$root/tables/time_step.md"
elif [ -f "$root/tables/time_runs.md" ]; then  # the runs' own phase timers (the quick profile)
  echo; echo "step time by phase, from the runs ($root/tables/time_runs.md):"; cat "$root/tables/time_runs.md"
fi
exit $status
