#!/usr/bin/env bash
# A real Slurm cluster on this machine, for tests and for trying the sbatch scripts: one node, or
# several (VAPO_SLURM_NODES=N), each in its own network namespace.
#
#   scripts/slurm_local.sh start    install Debian's slurm + munge if missing, write a private
#                                   slurm.conf, start munged/slurmctld/slurmd, wait for an idle node
#   scripts/slurm_local.sh stop     stop the daemons this script started (by the pids in their files)
#   scripts/slurm_local.sh status   exit 0 if the cluster answers and its node is up, else 1
#   scripts/slurm_local.sh env      print `export SLURM_CONF=...` (eval it to point sinfo/sbatch here)
#   scripts/slurm_local.sh exec CMD [ARGS...]
#                                   run a client command (sbatch, scontrol, ...) where it reaches the
#                                   controller: as is with one node, inside the controller's namespace
#                                   with several
#
# Everything lives in one state dir, VAPO_SLURM_DIR (default /tmp/vapo-slurm-<uid>): slurm.conf,
# logs, pid files, spool and state. The client commands find the cluster through SLURM_CONF=<dir>/slurm.conf.
# Needs root (the daemons run as root; Debian's packages, no systemd). Ports: VAPO_SLURM_CTLD_PORT
# (default 6817) and VAPO_SLURM_D_PORT (default 6818).
#
# Several nodes (VAPO_SLURM_NODES=N, N >= 2; state dir default /tmp/vapo-slurm-<uid>-N) look like
# real hosts: node i is NodeName <prefix>-n<i> with address <subnet>.(10+i), running its slurmd in its
# own network namespace (`ip netns`, named after the node) and UTS namespace (its hostname is its node
# name). The controller runs in a namespace <prefix>-ctl at <subnet>.1, which holds a bridge joining
# one veth pair per node. Each namespace gets a hosts file naming every node, /etc/netns/<ns>/hosts,
# bound over /etc/hosts in its daemons' own mount namespace (`ip netns exec` does the same for the
# client commands): node names resolve on every node, as on a cluster with DNS. Nothing is added to this machine's own network namespace; traffic stays between
# the addresses this script creates. VAPO_SLURM_PREFIX (default vapo<uid>) names the namespaces and
# nodes; VAPO_SLURM_SUBNET (default 10.213.0) the /24 they use. The namespaces share the filesystem
# (munge's socket, the run directory: a "shared filesystem" for free) and the machine's CPUs: each
# node declares all of them. Exit code 3 also when namespaces cannot be created here.
set -euo pipefail

NODES=${VAPO_SLURM_NODES:-1}
[[ $NODES =~ ^[1-9][0-9]?$ ]] || { echo "slurm_local.sh: error: VAPO_SLURM_NODES must be 1..99, got '$NODES'" >&2; exit 2; }
if [[ $NODES -eq 1 ]]; then
    STATE_DIR=${VAPO_SLURM_DIR:-/tmp/vapo-slurm-$(id -u)}
    NODE=$(hostname -s)
else
    STATE_DIR=${VAPO_SLURM_DIR:-/tmp/vapo-slurm-$(id -u)-$NODES}
    PREFIX=${VAPO_SLURM_PREFIX:-vapo$(id -u)}
    SUBNET=${VAPO_SLURM_SUBNET:-10.213.0}
    CTL_NS=$PREFIX-ctl
    NODE=$PREFIX-n1  # the first node; the others are $PREFIX-n2 ...
fi
CONF=$STATE_DIR/slurm.conf
CTLD_PORT=${VAPO_SLURM_CTLD_PORT:-6817}
D_PORT=${VAPO_SLURM_D_PORT:-6818}
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

multi() { [[ $NODES -gt 1 ]]; }
node_name() { if multi; then echo "$PREFIX-n$1"; else echo "$NODE"; fi; }
node_addr() { if multi; then echo "$SUBNET.$((10 + $1))"; else echo 127.0.0.1; fi; }
ctld_host() { if multi; then echo "$PREFIX-ctl($SUBNET.1)"; else echo "$NODE(127.0.0.1)"; fi; }
all_nodes() { if multi; then echo "$PREFIX-n[1-$NODES]"; else echo "$NODE"; fi; }

# Client commands (sinfo, squeue, scancel, sbatch...) where the controller can be reached.
client() { if multi; then ip netns exec "$CTL_NS" "$@"; else "$@"; fi; }

# slurm.conf's node and partition lines. With several nodes each gets an even share of the memory
# (they share this machine) and all of its CPUs.
node_lines() {
    local hw=$1 mem=$2 i
    if ! multi; then
        echo "NodeName=$NODE NodeAddr=127.0.0.1 $hw State=UNKNOWN"
    else
        hw=${hw/RealMemory=$mem/RealMemory=$((mem / NODES))}
        for i in $(seq "$NODES"); do echo "NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") $hw State=UNKNOWN"; done
    fi
    echo "PartitionName=local Nodes=$(all_nodes) Default=YES MaxTime=INFINITE State=UP"
}

write_conf() {
    # CPUs, sockets, cores and RealMemory exactly as slurmd sees them: a RealMemory above the real
    # amount leaves the node INVAL and every job pending forever.
    local hw cpus
    # One slurmd per node: with several, %n (the node name) keeps their files apart.
    local D_SUFFIX=""; multi && D_SUFFIX=-%n
    hw=$(slurmd -C | head -n1 | sed -e 's/^NodeName=[^ ]* //')
    [[ $hw =~ CPUs=([0-9]+) ]] || die "could not parse 'slurmd -C' output: $hw"
    cpus=${BASH_REMATCH[1]}
    [[ $hw =~ RealMemory=([0-9]+) ]] || die "could not parse RealMemory from 'slurmd -C' output: $hw"
    local mem=${BASH_REMATCH[1]}
    # Without a default per-CPU memory a job asks for the whole node; give each CPU its share.
    local def_mem=$(( mem / NODES / cpus ))
    mkdir -p "$STATE_DIR/ctld"
    cat >"$CONF.tmp" <<EOF
# Written by scripts/slurm_local.sh: $NODES node(s) on $(hostname -s) (Slurm $(slurmd -V | awk '{print $2}')).
ClusterName=vapo-local
SlurmctldHost=$(ctld_host)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (default 120 s); 10 s keeps tests short.
AuthInfo=cred_expire=10
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool$D_SUFFIX
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd$D_SUFFIX.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd$D_SUFFIX.log
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
$(node_lines "$hw" "$mem")
EOF
    mv "$CONF.tmp" "$CONF"
}

# Node states, one line per node ("idle", "down*", ...).
node_states() { client sinfo -h -N -o '%T' 2>/dev/null; }
slurmd_pidfile() { if multi; then echo "$STATE_DIR/slurmd-$(node_name "$1").pid"; else echo "$STATE_DIR/slurmd.pid"; fi; }
namespaces() { local i; echo "$CTL_NS"; for i in $(seq "$NODES"); do node_name "$i"; done; }

cmd_status() {
    [[ -f $CONF ]] || { echo "not configured ($CONF missing)"; return 1; }
    local ctld d i pids="" all_up=1 states="" ready=0
    ctld=$(live_pid "$STATE_DIR/slurmctld.pid")
    for i in $(seq "$NODES"); do
        d=$(live_pid "$(slurmd_pidfile "$i")")
        pids+=" ${d:-none}"
        [[ -n $d ]] || all_up=0
    done
    # sinfo retries for ~10 s when no slurmctld answers: ask only when it runs.
    if [[ -n $ctld ]]; then
        states=$(node_states || true)
        ready=$(grep -cE '^(idle|mixed|allocated|completing)$' <<<"$states" || true)
    fi
    echo "slurmctld pid=${ctld:-none} slurmd pid(s)=${pids# } node states: $(echo ${states:-unknown}) SLURM_CONF=$CONF"
    [[ -n $ctld && $all_up == 1 && $ready -eq $NODES ]]
}

# Several nodes: a controller namespace with a bridge, one namespace per node joined to the bridge
# by a veth pair, and a hosts file per namespace. Created inside the namespaces only (`ip -n`).
make_network() {
    command -v ip >/dev/null || cannot_install "no 'ip' command (iproute2) to create network namespaces"
    local err=$STATE_DIR/netns.err hosts i ns
    ip netns add "$CTL_NS" 2>"$err" || cannot_install "cannot create network namespaces here: $(<"$err")"
    ip -n "$CTL_NS" link set lo up
    ip -n "$CTL_NS" link add br0 type bridge 2>"$err" || cannot_install "cannot create a bridge in a network namespace: $(<"$err")"
    ip -n "$CTL_NS" addr add "$SUBNET.1/24" dev br0
    ip -n "$CTL_NS" link set br0 up
    hosts=$(printf '127.0.0.1 localhost\n%s.1 %s\n' "$SUBNET" "$CTL_NS")
    for i in $(seq "$NODES"); do
        ns=$(node_name "$i")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$CTL_NS" link add "n$i" type veth peer name eth0 netns "$ns" 2>"$err" \
            || cannot_install "cannot create veth pairs between network namespaces: $(<"$err")"
        ip -n "$CTL_NS" link set "n$i" master br0 up
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        hosts+=$(printf '\n%s %s' "$(node_addr "$i")" "$ns")
    done
    for ns in $(namespaces); do mkdir -p "/etc/netns/$ns"; echo "$hosts" >"/etc/netns/$ns/hosts"; done
}

# Deleting a namespace also deletes the veth ends and the bridge in it.
remove_network() {
    local ns
    for ns in $(namespaces); do
        if ip netns list | awk '{print $1}' | grep -qxF "$ns"; then ip netns del "$ns"; fi
        rm -rf "/etc/netns/${ns:?}"
    done
    rmdir /etc/netns 2>/dev/null || true  # only when no other namespace keeps files there
}

# Runs a daemon in network namespace $1 as if on a host named $1: its own UTS namespace (hostname)
# and mount namespace, where the namespace's hosts file is bound over /etc/hosts. Not `ip netns
# exec`: it also remounts /sys, which hides /sys/fs/cgroup, and slurmd will not start without it.
in_host() {
    local ns=$1; shift
    nsenter --net="/run/netns/$ns" unshare --mount --uts --propagation slave \
        sh -c 'mount --bind "/etc/netns/$0/hosts" /etc/hosts && hostname "$0" && exec "$@"' "$ns" "$@"
}

start_daemons() {
    local i
    if [[ -z $(live_pid "$STATE_DIR/slurmctld.pid") ]]; then
        write_conf
        # -c: a fresh controller. State saved by an earlier run of this state dir is dropped: a job
        # that was running when that cluster was stopped would otherwise be restored as running and
        # keep the node allocated (seen when one test run stopped the cluster under another's job).
        if multi; then
            remove_network  # left over from a run that was killed before its stop
            make_network
            in_host "$CTL_NS" slurmctld -c || die "slurmctld failed to start, see $STATE_DIR/slurmctld.log"
        else
            slurmctld -c || die "slurmctld failed to start, see $STATE_DIR/slurmctld.log"
        fi
    fi
    for i in $(seq "$NODES"); do
        [[ -z $(live_pid "$(slurmd_pidfile "$i")") ]] || continue
        if multi; then
            mkdir -p "$STATE_DIR/spool-$(node_name "$i")"
            in_host "$(node_name "$i")" slurmd -N "$(node_name "$i")" || die "slurmd failed to start, see $STATE_DIR/slurmd-$(node_name "$i").log"
        else
            mkdir -p "$STATE_DIR/spool"
            slurmd -N "$NODE" || die "slurmd failed to start, see $STATE_DIR/slurmd.log"
        fi
    done
}

cmd_start() {
    mkdir -p "$STATE_DIR"
    if cmd_status >/dev/null 2>&1; then log "already running: $(cmd_status)"; return 0; fi
    need_root
    install_packages
    start_munge
    start_daemons
    local states="" idle=0
    for _ in $(seq 300); do
        states=$(node_states || true)
        idle=$(grep -cx idle <<<"$states" || true)
        if [[ $idle -eq $NODES ]]; then log "up: $NODES node(s) idle ($(all_nodes)); export SLURM_CONF=$CONF"; return 0; fi
        sleep 0.1
    done
    die "$(all_nodes): $idle of $NODES node(s) idle after 30 s (states: $(echo ${states:-none})); see $STATE_DIR/slurmctld.log and $STATE_DIR/slurmd*.log"
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
        jobs=$(client squeue -h -o '%A' 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086
            client scancel $jobs 2>/dev/null || true
            for _ in $(seq 100); do
                [[ -z $(client squeue -h -t running,completing -o '%A' 2>/dev/null || true) ]] && break
                sleep 0.1
            done
        fi
    fi
    # slurmd next: it ends the job steps it runs (with a live slurmctld to report to).
    local i
    for i in $(seq "$NODES"); do stop_pidfile "slurmd $(node_name "$i")" "$(slurmd_pidfile "$i")"; done
    stop_pidfile slurmctld "$STATE_DIR/slurmctld.pid"
    stop_pidfile munged "$STATE_DIR/munged.pid"  # only if this script started it
    if multi; then remove_network; fi
    log "stopped"
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    exec) shift; [[ $# -ge 1 ]] || { echo "usage: $0 exec CMD [ARGS...]" >&2; exit 2; }; client "$@" ;;
    *) echo "usage: $0 start|stop|status|env|exec CMD [ARGS...]" >&2; exit 2 ;;
esac
