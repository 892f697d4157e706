#!/usr/bin/env bash
# Install (first call only), launch a profile, then the analysis step.
#   ./run_all.sh                                  # quick profile: every method a few steps on CPU + memory table (minutes)
#   ./run_all.sh --profile cpu                    # the CPU reproduction (hours; rerun to resume after a stop)
#   ./run_all.sh --profile paper --launcher slurm launcher.partition=gpu launcher.account=me
#   ./run_all.sh --profile paper --dry-run        # list the paper jobs and their planned memory per GPU
# Other arguments go to `python -m experiments.launch` (launcher.<key>=..., root=..., key=value run overrides).
# Results: results/<profile>/ (runs/<name>-<hash8>/, memory/, summary.csv, tables/, figures/).
set -euo pipefail
cd "$(dirname "$0")"
profile=quick launcher="" dry_run=0 rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --profile=*) profile="${1#*=}"; shift ;;
    --launcher) launcher="$2"; shift 2 ;;
    --launcher=*) launcher="${1#*=}"; shift ;;
    --dry-run|-n) dry_run=1; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) rest+=("$1"); shift ;;
  esac
done
case "$profile" in quick|cpu|paper) ;; *) echo "unknown profile '$profile' (quick | cpu | paper)" >&2; exit 2 ;; esac
if [ "$profile" = paper ] && [ "$launcher" != slurm ] && [ "$dry_run" = 0 ]; then
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
args=("sweep=$profile")
[ -n "$launcher" ] && args+=("launcher=$launcher")
[ "$dry_run" = 1 ] && args+=(--dry-run)
root="results/$profile"
for a in ${rest[@]+"${rest[@]}"}; do case "$a" in root=*) root="${a#root=}" ;; esac; done
status=0
python -m experiments.launch "${args[@]}" ${rest[@]+"${rest[@]}"} || status=$?
[ "$dry_run" = 1 ] && exit $status
# The analysis step: tables and figures of every run under the root (results/<profile>/tables, figures).
python -m analysis "$root" || status=$?
if [ -f "$root/memory/memory.csv" ]; then
  echo
  if [ -f "$root/tables/memory_step.md" ]; then  # the analysis step's rendering: MiB, x dense
    echo "memory table ($root/tables/memory_step.md, from $root/memory/memory.csv):"; cat "$root/tables/memory_step.md"
  else
    echo "memory table ($root/memory/memory.csv):"
    python -c "import csv,sys; rows=list(csv.reader(open(sys.argv[1]))); w=[max(len(r[i]) for r in rows) for i in range(len(rows[0]))]; [print('  '.join(c.ljust(x) for c,x in zip(r,w))) for r in rows]" "$root/memory/memory.csv"
  fi
  echo "figures: $(ls "$root"/memory/*.png "$root"/memory/*.pdf "$root"/figures/*.png 2>/dev/null | tr '\n' ' ')"
fi
if [ -f "$root/tables/time_step.md" ]; then  # python -m experiments.time_table, rendered by the analysis step
  echo; echo "time table ($root/tables/time_step.md, from $root/time/time.csv; figure $root/time/time.png):"; cat "$root/tables/time_step.md"
fi
exit $status
