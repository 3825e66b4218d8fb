#!/usr/bin/env bash
# A real SLURM on this machine, on loopback: munged + slurmctld + one slurmd per node (Debian's slurm-wlm), all
# with their state, sockets, logs and pid files in one folder, so that several can run side by side (each on free
# ports of its own) and `down` stops exactly what `up` started.
#
#   scripts/local_slurm.sh up [FOLDER] [--nodes N]  start it (default FOLDER /tmp/stratbench-slurm, N 1 or
#                                            $STRATBENCH_SLURM_NODES); prints the `export SLURM_CONF=...` that
#                                            points sinfo/sbatch/squeue at it
#   scripts/local_slurm.sh status [FOLDER]  sinfo and squeue of it
#   scripts/local_slurm.sh down [FOLDER]    cancel its jobs, stop its daemons
#   scripts/local_slurm.sh install          the packages only, as root with apt-get (else nothing): the set-up's
#
# One node `localhost` (127.0.0.1) with this machine's CPUs; with --nodes N, N nodes `node1`..`nodeN`, each a
# slurmd of its own (`slurmd -N nodeI`, its own port, spool, log and pid file) at NodeAddr 127.0.0.1 with all of
# this machine's CPUs (oversubscribed: a 2-process cell fits on one node, or on two): multi-node jobs on one
# machine. One partition `debug` (the default). Jobs start as soon as they are submitted (sched/builtin);
# processes are tracked through /proc (proctrack/linuxproc), so no cgroups are needed (a container is fine).
# Needs root (slurmd runs jobs as their user) and, when the packages are missing, apt-get (it installs slurmctld,
# slurmd, slurm-client and munge). Used by tests/compare/test_slurm.py (2 nodes), benchmarks/executor_overhead.py
# and the README tour; docs/cluster.md.
set -euo pipefail

ACTION=${1:-}
[ $# -gt 0 ] && shift
STATE=${STRATBENCH_SLURM_DIR:-/tmp/stratbench-slurm}
NODES=${STRATBENCH_SLURM_NODES:-1}
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES=${2:-}; shift $(($# > 1 ? 2 : 1)) ;;
        --nodes=*) NODES=${1#--nodes=}; shift ;;
        -*) echo "local_slurm.sh: unknown option $1 (known: --nodes N)" >&2; exit 1 ;;
        *) STATE=$1; shift ;;
    esac
done
case "$NODES" in
    [1-9] | [1-9][0-9]) ;;
    *) echo "local_slurm.sh: --nodes '$NODES' is not a number of nodes from 1 to 99" >&2; exit 1 ;;
esac
PACKAGES="slurmctld slurmd slurm-client munge"

die() { echo "local_slurm.sh: $*" >&2; exit 1; }

installed() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null
}

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null 2>&1
}

install_packages() {
    installed && return 0
    [ "$(id -u)" = 0 ] || die "SLURM is not installed and this is not root: apt-get install $PACKAGES as root"
    command -v apt-get >/dev/null || die "SLURM is not installed and there is no apt-get: install $PACKAGES"
    echo "local_slurm.sh: installing $PACKAGES" >&2
    apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; } || die "apt-get install $PACKAGES failed"
}

install_quietly() {  # the set-up (scripts/install.sh): only as root with apt-get, never fails
    installed && return 0
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 0
    if apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; }; then
        echo "install: installed $PACKAGES (a local SLURM for --executor slurm: scripts/local_slurm.sh up)"
    fi
    return 0
}

free_ports() {  # N distinct free ports on loopback (all bound at once, so none repeats)
    python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

node_names() {  # one node: `localhost` (as before); N nodes: node1..nodeN
    if [ "$NODES" = 1 ]; then echo localhost; else seq -f 'node%g' 1 "$NODES"; fi
}

write_conf() {
    local cpus ports ctld_port name names
    # the machine's CPUs (this process's affinity), not a thread setting: nproc honours OMP_NUM_THREADS, and a shell
    # (or the test suite) with OMP_NUM_THREADS=1 gave the node 1 CPU, too few for a 2-process cell. Every node
    # gets them all: the nodes share this machine's cores (oversubscribed, as 2 processes on 2 nodes need).
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    read -r ctld_port ports <<<"$(free_ports $((NODES + 1)))"
    names=$(node_names | paste -sd, -)
    : >"$STATE/plugstack.conf"
    cat >"$STATE/slurm.conf" <<EOF
# written by scripts/local_slurm.sh: a SLURM of $NODES node(s) on loopback, one slurmd each (slurmd -N NAME)
ClusterName=stratbench
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=${ports%% *}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
PlugStackConfig=$STATE/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
EOF
    for name in $(node_names); do  # each slurmd on a port of its own, all at 127.0.0.1
        echo "NodeName=$name NodeAddr=127.0.0.1 Port=${ports%% *} CPUs=$cpus State=UNKNOWN" >>"$STATE/slurm.conf"
        ports=${ports#* }
    done
    echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP" >>"$STATE/slurm.conf"
}

start_munge() {
    mkdir -p "$STATE/munge"
    chmod 700 "$STATE/munge"
    [ -f "$STATE/munge/munge.key" ] || mungekey --create --keyfile="$STATE/munge/munge.key" >/dev/null 2>&1 \
        || dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$STATE/munge/munge.key"
    munged --force --socket="$STATE/munge/munge.socket" --key-file="$STATE/munge/munge.key" \
        --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
        --seed-file="$STATE/munge/munged.seed" \
        || die "munged did not start (see $STATE/munge/munged.log)"
}

wait_idle() {  # until sinfo shows every node idle
    local i idle
    for i in $(seq 1 150); do
        idle=$(sinfo -h -N -o %t 2>/dev/null | grep -c '^idle$' || true)
        if [ "$idle" = "$(conf_nodes)" ]; then
            return 0
        fi
        sleep 0.2
    done
    die "the nodes did not become idle within 30 s: $(sinfo -h -N -o '%n %t %E' 2>&1 | tr '\n' ';' | head -c 300)" \
        "(logs: $STATE/*.log)"
}

conf_nodes() {  # the nodes of the running SLURM of this folder (its slurm.conf)
    grep -c '^NodeName=' "$STATE/slurm.conf" 2>/dev/null || echo 0
}

running() {  # the daemons of this folder that are alive (slurmd.pid: one an older local_slurm.sh started)
    local file pid
    for file in "$STATE/munge/munged.pid" "$STATE/slurmctld.pid" "$STATE"/slurmd-*.pid "$STATE/slurmd.pid"; do
        pid=$(cat "$file" 2>/dev/null || true)
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "$(basename "$file" .pid):$pid"; fi
    done
}

up() {
    [ "$(id -u)" = 0 ] || die "needs root (slurmd starts jobs as their user): run it as root"
    install_packages
    export SLURM_CONF="$STATE/slurm.conf"
    if [ -n "$(running)" ]; then
        [ "$(conf_nodes)" = "$NODES" ] || die "already running with $(conf_nodes) node(s) in $STATE, not $NODES:" \
            "scripts/local_slurm.sh down $STATE first"
        wait_idle
        echo "export SLURM_CONF=$SLURM_CONF"
        return 0
    fi
    mkdir -p "$STATE/ctld"
    write_conf
    start_munge
    # -i: ignore saved jobs and node states of an earlier run in this folder
    slurmctld -i -f "$SLURM_CONF" || die "slurmctld did not start (see $STATE/slurmctld.log)"
    local name
    for name in $(node_names); do
        mkdir -p "$STATE/slurmd-$name"
        slurmd -N "$name" -f "$SLURM_CONF" || die "slurmd -N $name did not start (see $STATE/slurmd-$name.log)"
    done
    wait_idle
    echo "export SLURM_CONF=$SLURM_CONF"
}

down() {
    export SLURM_CONF="$STATE/slurm.conf"
    if [ -n "$(running)" ] && [ -f "$SLURM_CONF" ]; then
        scancel --full --quiet --partition debug >/dev/null 2>&1 || true
        local i
        for i in $(seq 1 50); do  # the jobs' processes are killed by slurmd (KillWait 5 s)
            [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    local pids entry
    pids=$(running | cut -d: -f2)
    [ -n "$pids" ] || return 0
    for entry in $pids; do kill -TERM "$entry" 2>/dev/null || true; done
    for _ in $(seq 1 100); do  # all at once, up to 10 s
        alive=""
        for entry in $pids; do kill -0 "$entry" 2>/dev/null && alive="$alive $entry"; done
        [ -z "$alive" ] && return 0
        sleep 0.1
    done
    for entry in $alive; do kill -KILL "$entry" 2>/dev/null || true; done
}

status() {
    export SLURM_CONF="$STATE/slurm.conf"
    [ -n "$(running)" ] || die "not running (folder $STATE)"
    echo "daemons: $(running | tr '\n' ' ')"
    sinfo
    squeue
}

case "$ACTION" in
    up) up ;;
    down) down ;;
    status) status ;;
    install) install_quietly ;;
    *) die "usage: scripts/local_slurm.sh up [FOLDER] [--nodes N] | down|status [FOLDER] | install" ;;
esac
