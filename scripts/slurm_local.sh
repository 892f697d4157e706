#!/usr/bin/env bash
# A single-node SLURM cluster on 127.0.0.1, with accounting, under one temporary directory: munged,
# MariaDB + slurmdbd (sacct), slurmctld, slurmd, and fake GPUs (gres) so --gpus-per-node sets
# CUDA_VISIBLE_DEVICES. For trying the SLURM path of the launcher on one machine and for the `slurm`
# test tier (docs/usage.md, "SLURM on one machine"). Run as root (CI, a container; `sudo -E` on a laptop).
#   eval "$(scripts/slurm_local.sh start)"     # prints `export SLURM_CONF=<dir>/slurm.conf`; ~5 s
#   scripts/slurm_local.sh status              # daemons, node, queue
#   scripts/slurm_local.sh stop                # cancels its jobs, stops its daemons by their PIDs, removes <dir>
# The cluster's directory: $LOGRA_SLURM_DIR, else (stop/status) the folder of $SLURM_CONF, else (start) a
# new mktemp folder. Settings (environment):
#   LOGRA_SLURM_CTLD_PORT, _SLURMD_PORT, _DBD_PORT, _DB_PORT   ports (default: free ports found by probing)
#   LOGRA_SLURM_CPUS (8)  CPUs the node claims (may exceed the machine's: SlurmdParameters=config_overrides)
#   LOGRA_SLURM_GPUS (8)  fake GPUs (gres gpu:N on device files <dir>/dev/nvidia<i>)
#   LOGRA_SLURM_INSTALL (1)  install the Debian packages when missing (apt-get; 0: fail instead)
#   LOGRA_SLURM_KEEP (0)  stop keeps <dir> (logs) instead of removing it
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server-core mariadb-client-core)
COMMANDS=(munged mungekey slurmctld slurmd slurmdbd sbatch sacct scontrol mariadbd mariadb-install-db mariadb)
say() { echo "[slurm_local] $*" >&2; }
die() { say "error: $*"; exit 1; }
unavailable() { say "unavailable: $*"; exit 3; }  # exit 3: the packages cannot be had here (the tests skip)

cluster_dir() {  # the directory of an existing cluster (stop, status)
  if [ -n "${LOGRA_SLURM_DIR:-}" ]; then echo "$LOGRA_SLURM_DIR"
  elif [ -n "${SLURM_CONF:-}" ] && [ -f "$(dirname "$SLURM_CONF")/.logra-slurm" ]; then dirname "$SLURM_CONF"
  else die "no cluster named: set LOGRA_SLURM_DIR or SLURM_CONF (what start printed)"; fi
}

missing_commands() {
  local c out=()
  for c in "${COMMANDS[@]}"; do
    command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || out+=("$c")
  done
  echo "${out[@]:-}"
}

install_packages() {
  # On a host with systemd the packages' maintainer scripts start system services (munge, slurmd, ...)
  # that would hold the default sockets and ports: a policy-rc.d that refuses every start keeps them
  # off during the install, and the services are disabled afterwards (this cluster runs its own).
  [ "${LOGRA_SLURM_INSTALL:-1}" = 1 ] || unavailable "missing $(missing_commands); install: apt-get install -y --no-install-recommends ${PACKAGES[*]}"
  [ "$(id -u)" = 0 ] || unavailable "missing $(missing_commands); installing needs root (apt-get install ${PACKAGES[*]})"
  command -v apt-get >/dev/null || unavailable "missing $(missing_commands) and no apt-get to install ${PACKAGES[*]}"
  local policy=/usr/sbin/policy-rc.d placed=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"; placed=1; fi
  say "installing ${PACKAGES[*]} (apt-get, --no-install-recommends)"
  local rc=0
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2 ||
    { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2; }; } || rc=$?
  [ "$placed" = 1 ] && rm -f "$policy"
  [ "$rc" = 0 ] || unavailable "apt-get install ${PACKAGES[*]} failed (exit $rc)"
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    systemctl disable --now munge slurmd slurmctld slurmdbd >/dev/null 2>&1 || true
  fi
}

port_free() {  # nothing listens on 127.0.0.1:$1
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

pick_port() {  # $1: the env var naming a port; else a free one from a random start, not among $TAKEN
  local name=$1 p
  if [ -n "${!name:-}" ]; then port_free "${!name}" || die "$name=${!name} is taken"; echo "${!name}"; return; fi
  for _ in $(seq 200); do
    p=$(( 20000 + RANDOM % 40000 ))
    case " $TAKEN " in *" $p "*) continue ;; esac
    if port_free "$p"; then echo "$p"; return; fi
  done
  die "no free port found for $name"
}

wait_for() {  # $1 seconds, $2 what, then a command that succeeds when ready
  local limit=$1 what=$2 t0=$SECONDS; shift 2
  until "$@" >/dev/null 2>&1; do
    [ $(( SECONDS - t0 )) -lt "$limit" ] || { say "$what not ready after ${limit} s; its log:"; tail -n 20 "$LOG_OF" >&2 || true; return 1; }
    sleep 0.2
  done
}

write_configs() {
  local mem_mb cpus=$1 gpus=$2
  mem_mb=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
  mem_mb=$(( mem_mb > 2048 ? mem_mb - 1024 : mem_mb ))
  # jobs share the node: without DefMemPerCPU each job would take the whole node's memory, one at a time
  cat > "$D/slurm.conf" <<EOF
# A single-node cluster made by scripts/slurm_local.sh; everything lives in $D.
ClusterName=logra
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket,cred_expire=5
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$(( mem_mb / cpus ))
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$D/munge/munge.socket
JobCompType=jobcomp/none
MailProg=/bin/true
KillWait=5
MinJobAge=60
# requeued jobs wait out cred_expire; then the periodic loops start them: every second here, not every 30-60 s
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb Gres=gpu:$gpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  : > "$D/gres.conf"
  local i
  for (( i = 0; i < gpus; i++ )); do echo "NodeName=localhost Name=gpu File=$D/dev/nvidia$i" >> "$D/gres.conf"; done
  # slurmdbd has no -f: it reads slurmdbd.conf beside $SLURM_CONF, and only when private (mode 600)
  cat > "$D/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=root
StorageLoc=slurm_acct_db
PidFile=$D/run/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
EOF
  chmod 600 "$D/slurmdbd.conf"
}

fake_gpus() {  # character devices like NVIDIA's (major 195); plain files where mknod is refused
  local i gpus=$1
  mkdir -p "$D/dev"
  for (( i = 0; i < gpus; i++ )); do
    mknod "$D/dev/nvidia$i" c 195 "$i" 2>/dev/null || : > "$D/dev/nvidia$i"
  done
}

start() {
  [ "$(id -u)" = 0 ] || unavailable "run as root (slurmd launches jobs as their users); on a laptop: sudo -E $0 start"
  [ -z "$(missing_commands)" ] || install_packages
  [ -z "$(missing_commands)" ] || unavailable "still missing after the install: $(missing_commands)"
  D=${LOGRA_SLURM_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/logra-slurm.XXXXXX")}
  mkdir -p "$D"
  [ ! -e "$D/run/slurmctld.pid" ] || die "$D already holds a cluster (stop it first)"
  D=$(cd "$D" && pwd)
  chmod 755 "$D"
  mkdir -p "$D"/{munge,db,state,spool,run,log}
  chmod 755 "$D/munge"  # clients (jobs of any user) reach munged's socket through it
  touch "$D/.logra-slurm"
  TAKEN=""
  CTLD_PORT=$(pick_port LOGRA_SLURM_CTLD_PORT); TAKEN="$TAKEN $CTLD_PORT"
  SLURMD_PORT=$(pick_port LOGRA_SLURM_SLURMD_PORT); TAKEN="$TAKEN $SLURMD_PORT"
  DBD_PORT=$(pick_port LOGRA_SLURM_DBD_PORT); TAKEN="$TAKEN $DBD_PORT"
  DB_PORT=$(pick_port LOGRA_SLURM_DB_PORT)
  local cpus=${LOGRA_SLURM_CPUS:-8} gpus=${LOGRA_SLURM_GPUS:-8}
  write_configs "$cpus" "$gpus"
  fake_gpus "$gpus"
  echo "ctld=$CTLD_PORT slurmd=$SLURMD_PORT dbd=$DBD_PORT db=$DB_PORT" > "$D/ports"
  export SLURM_CONF="$D/slurm.conf"

  say "munged"
  LOG_OF=$D/log/munged.log
  dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
  chmod 600 "$D/munge/munge.key"
  daemon munged --force --socket="$D/munge/munge.socket" --key-file="$D/munge/munge.key" --pid-file="$D/run/munged.pid" \
         --log-file="$LOG_OF" --seed-file="$D/munge/munged.seed"
  wait_for 10 munged test -S "$D/munge/munge.socket"

  say "MariaDB on 127.0.0.1:$DB_PORT"
  LOG_OF=$D/log/mariadb.log
  # no mariadb-install-db (4 s of writing files): with --skip-grant-tables an empty data directory
  # serves slurmdbd, which creates its own tables; a throwaway database needs no durable log
  daemon mariadbd --no-defaults --datadir="$D/db" --user=root --bind-address=127.0.0.1 --port="$DB_PORT" \
         --socket="$D/run/mariadb.sock" --pid-file="$D/run/mariadb.pid" --log-error="$LOG_OF" --skip-grant-tables \
         --skip-name-resolve --skip-log-bin --innodb-buffer-pool-size=32M --innodb-log-file-size=4M \
         --innodb-flush-log-at-trx-commit=0
  wait_for 30 MariaDB mariadb --no-defaults --protocol=tcp -h 127.0.0.1 -P "$DB_PORT" -u root -e 'select 1'

  say "slurmdbd on 127.0.0.1:$DBD_PORT"
  LOG_OF=$D/log/slurmdbd.log
  daemon slurmdbd
  wait_for 30 slurmdbd sacctmgr -n list cluster

  say "slurmctld on 127.0.0.1:$CTLD_PORT"
  LOG_OF=$D/log/slurmctld.log
  daemon slurmctld -i
  wait_for 30 slurmctld scontrol ping

  say "slurmd on 127.0.0.1:$SLURMD_PORT ($cpus CPUs, $gpus fake GPUs)"
  LOG_OF=$D/log/slurmd.log
  daemon slurmd -N localhost
  wait_for 30 "the node" node_idle
  wait_for 30 "accounting" sacct -n -X -S now-1hour
  say "up: $D (logs in $D/log); stop with: $0 stop"
  echo "export SLURM_CONF=$D/slurm.conf"
}

daemon() {  # start a daemon in the background holding no descriptor of ours: the caller's pipe
  # (eval "$(scripts/slurm_local.sh start)") sees EOF when this script ends
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-"
    done
    exec "$@"
  ) < /dev/null > /dev/null 2>> "$LOG_OF" &
}

node_idle() { [ "$(sinfo -h -n localhost -o %T 2>/dev/null)" = idle ]; }

stop_all() {  # TERM to every daemon at once, KILL to what is left after 10 s
  local name pid pids=() t0=$SECONDS
  for name in slurmd slurmctld slurmdbd mariadb munged; do
    pid=$(cat "$D/run/$name.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null && pids+=("$pid"); fi
  done
  for pid in ${pids[@]+"${pids[@]}"}; do
    while kill -0 "$pid" 2>/dev/null; do
      if [ $(( SECONDS - t0 )) -ge 10 ]; then kill -9 "$pid" 2>/dev/null || true; break; fi
      sleep 0.1
    done
  done
  rm -f "$D"/run/*.pid
}

stop() {
  D=$(cluster_dir)
  [ -f "$D/.logra-slurm" ] || die "$D is not a cluster made by $0"
  export SLURM_CONF="$D/slurm.conf"
  if [ -f "$D/run/slurmctld.pid" ] && scontrol ping >/dev/null 2>&1; then  # end its jobs first: their slurmstepd go with them
    scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    local t0=$SECONDS
    while [ -n "$(squeue -h -o %i 2>/dev/null)" ] && [ $(( SECONDS - t0 )) -lt 15 ]; do sleep 0.3; done
  fi
  stop_all
  if [ "${LOGRA_SLURM_KEEP:-0}" = 1 ]; then say "stopped; kept $D"; else rm -rf "$D"; say "stopped; removed $D"; fi
}

status() {
  D=$(cluster_dir)
  export SLURM_CONF="$D/slurm.conf"
  local name pid
  echo "cluster $D ($(cat "$D/ports" 2>/dev/null))"
  for name in munged mariadb slurmdbd slurmctld slurmd; do
    pid=$(cat "$D/run/$name.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "  $name: running (pid $pid)"; else echo "  $name: not running"; fi
  done
  sinfo -N -o "  node %N %T cpus=%c mem=%m gres=%G" 2>/dev/null || echo "  slurmctld does not answer"
  squeue -o "  %.12i %.10T %.20j %R" 2>/dev/null || true
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
