#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for tests and for trying the sbatch scripts.
#
#   scripts/slurm_local.sh start    install Debian's slurm + munge if missing, write a private
#                                   slurm.conf, start munged/slurmctld/slurmd, wait for an idle node
#   scripts/slurm_local.sh stop     stop the daemons this script started (by the pids in their files)
#   scripts/slurm_local.sh status   exit 0 if the cluster answers and its node is up, else 1
#   scripts/slurm_local.sh env      print `export SLURM_CONF=...` (eval it to point sinfo/sbatch here)
#
# Everything lives in one state dir, VAPO_SLURM_DIR (default /tmp/vapo-slurm-<uid>): slurm.conf,
# logs, pid files, spool and state. The client commands find the cluster through SLURM_CONF=<dir>/slurm.conf.
# Needs root (the daemons run as root; Debian's packages, no systemd). Ports: VAPO_SLURM_CTLD_PORT
# (default 6817) and VAPO_SLURM_D_PORT (default 6818).
set -euo pipefail

STATE_DIR=${VAPO_SLURM_DIR:-/tmp/vapo-slurm-$(id -u)}
CONF=$STATE_DIR/slurm.conf
CTLD_PORT=${VAPO_SLURM_CTLD_PORT:-6817}
D_PORT=${VAPO_SLURM_D_PORT:-6818}
NODE=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge)
export SLURM_CONF=$CONF

die() { echo "slurm_local.sh: error: $*" >&2; exit 1; }
# Exit code 3: Slurm cannot be installed here (tests skip on it; every other failure is an error).
cannot_install() { echo "slurm_local.sh: cannot install Slurm: $*" >&2; exit 3; }
log() { echo "slurm_local.sh: $*" >&2; }

need_root() {
    [[ $(id -u) -eq 0 ]] || cannot_install "must run as root to start the Slurm and munge daemons (uid $(id -u))"
}

# Prints the pid in $1 if that process is alive, else nothing.
live_pid() {
    local file=$1 pid
    [[ -s $file ]] || return 0
    pid=$(<"$file")
    if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then echo "$pid"; fi
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null || cannot_install "${missing[*]} missing and there is no apt-get"
    [[ $(id -u) -eq 0 ]] || cannot_install "${missing[*]} missing and installing needs root (uid $(id -u))"
    log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${PACKAGES[@]}" >"$STATE_DIR/apt.log" 2>&1; then
        log "apt-get install failed; running apt-get update once and retrying"
        apt-get update >>"$STATE_DIR/apt.log" 2>&1 || cannot_install "apt-get update failed, see $STATE_DIR/apt.log"
        apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>"$STATE_DIR/apt.log" 2>&1 \
            || cannot_install "apt-get install ${PACKAGES[*]} failed, see $STATE_DIR/apt.log"
    fi
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_works; then return 0; fi
    [[ -s /etc/munge/munge.key ]] || { log "creating /etc/munge/munge.key"; mungekey --create; chown munge:munge /etc/munge/munge.key; }
    # munged refuses to run as root and checks that its socket dir belongs to its own user.
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    runuser -u munge -- munged || die "munged failed to start, see /var/log/munge/munged.log"
    for _ in $(seq 50); do
        if munge_works; then cp /run/munge/munged.pid "$STATE_DIR/munged.pid"; return 0; fi  # ours to stop
        sleep 0.1
    done
    die "munged started but 'munge -n | unmunge' fails, see /var/log/munge/munged.log"
}

write_conf() {
    # CPUs, sockets, cores and RealMemory exactly as slurmd sees them: a RealMemory above the real
    # amount leaves the node INVAL and every job pending forever.
    local hw cpus
    hw=$(slurmd -C | head -n1 | sed -e 's/^NodeName=[^ ]* //')
    [[ $hw =~ CPUs=([0-9]+) ]] || die "could not parse 'slurmd -C' output: $hw"
    cpus=${BASH_REMATCH[1]}
    [[ $hw =~ RealMemory=([0-9]+) ]] || die "could not parse RealMemory from 'slurmd -C' output: $hw"
    local mem=${BASH_REMATCH[1]}
    # Without a default per-CPU memory a job asks for the whole node; give each CPU its share.
    local def_mem=$(( mem / cpus ))
    mkdir -p "$STATE_DIR/ctld" "$STATE_DIR/spool"
    cat >"$CONF.tmp" <<EOF
# Written by scripts/slurm_local.sh: a one-node cluster on $NODE (Slurm $(slurmd -V | awk '{print $2}')).
ClusterName=vapo-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (default 120 s); 10 s keeps tests short.
AuthInfo=cred_expire=10
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups here (containers, no systemd): track processes through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# Look at pending jobs every few seconds (defaults 60 s and 30 s): a requeued job starts soon after
# its cred_expire wait.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$def_mem
# No slurmdbd: no accounting (read job state with 'scontrol show job'); completed jobs also go to a text file.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/jobcomp.txt
# A node that was down comes back by itself; finished jobs stay visible to scontrol for an hour.
ReturnToService=2
MinJobAge=3600
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$NODE NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

node_state() { sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n1; }

cmd_status() {
    [[ -f $CONF ]] || { echo "not configured ($CONF missing)"; return 1; }
    local ctld d state
    ctld=$(live_pid "$STATE_DIR/slurmctld.pid"); d=$(live_pid "$STATE_DIR/slurmd.pid")
    # sinfo retries for ~10 s when no slurmctld answers: ask only when it runs.
    [[ -n $ctld ]] && state=$(node_state || true)
    echo "slurmctld pid=${ctld:-none} slurmd pid=${d:-none} node $NODE state=${state:-unknown} SLURM_CONF=$CONF"
    [[ -n $ctld && -n $d && $state =~ ^(idle|mixed|allocated|completing)$ ]]
}

cmd_start() {
    mkdir -p "$STATE_DIR"
    if cmd_status >/dev/null 2>&1; then log "already running: $(cmd_status)"; return 0; fi
    need_root
    install_packages
    start_munge
    if [[ -z $(live_pid "$STATE_DIR/slurmctld.pid") ]]; then
        write_conf
        # -c: a fresh controller. State saved by an earlier run of this state dir is dropped: a job
        # that was running when that cluster was stopped would otherwise be restored as running and
        # keep the node allocated (seen when one test run stopped the cluster under another's job).
        slurmctld -c || die "slurmctld failed to start, see $STATE_DIR/slurmctld.log"
    fi
    if [[ -z $(live_pid "$STATE_DIR/slurmd.pid") ]]; then
        slurmd -N "$NODE" || die "slurmd failed to start, see $STATE_DIR/slurmd.log"
    fi
    local state=""
    for _ in $(seq 300); do
        state=$(node_state || true)
        if [[ $state == idle ]]; then log "up: node $NODE idle; export SLURM_CONF=$CONF"; return 0; fi
        sleep 0.1
    done
    die "node $NODE did not become idle within 30 s (state '${state:-none}'); see $STATE_DIR/slurmctld.log and $STATE_DIR/slurmd.log"
}

stop_pidfile() {
    local name=$1 file=$2 pid
    pid=$(live_pid "$file")
    [[ -n $pid ]] || { rm -f "$file"; return 0; }
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { rm -f "$file"; return 0; }; sleep 0.1; done
    log "$name (pid $pid) did not exit after SIGTERM within 10 s; sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$file"
}

cmd_stop() {
    # Cancel this cluster's jobs first: slurmd exits without ending the job steps it started, whose
    # slurmstepd and tasks would otherwise outlive the cluster.
    if [[ -n $(live_pid "$STATE_DIR/slurmctld.pid") ]]; then
        local jobs
        jobs=$(squeue -h -o '%A' 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for _ in $(seq 100); do
                [[ -z $(squeue -h -t running,completing -o '%A' 2>/dev/null || true) ]] && break
                sleep 0.1
            done
        fi
    fi
    # slurmd next: it ends the job steps it runs (with a live slurmctld to report to).
    stop_pidfile slurmd "$STATE_DIR/slurmd.pid"
    stop_pidfile slurmctld "$STATE_DIR/slurmctld.pid"
    stop_pidfile munged "$STATE_DIR/munged.pid"  # only if this script started it
    log "stopped"
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
