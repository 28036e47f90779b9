#!/usr/bin/env bash
# Start a real one-node Slurm on this machine (Debian's slurm-wlm and munge), for
# the tests marked `slurm` (tests/slurm.py, tests/engines/test_slurm.py).
#
#   bash scripts/start_slurm.sh          # install if needed, start, check; idempotent
#   bash scripts/start_slurm.sh stop     # stop the daemons this script started
#
# On success it prints one line, `slurm: ready (SLURM_CONF=...)`, and exits 0;
# otherwise one line `slurm: unavailable: WHY` and a non-zero exit. Every wait has
# a time-out: about 3 minutes at worst, with apt-get installing the packages.
#
# Everything lives in a directory of its own, $PYRO_DISTRIBUTED_SLURM_DIR (default
# /run/pyro-distributed-slurm): the config, a munge key, munged's socket, the
# state, the logs and the pid files. /etc/slurm/slurm.conf is left alone, even
# when there is none: a file there would be read by every Slurm client on the
# machine and outlive these daemons, and where a site's Slurm is configured it
# must not be replaced. So the clients need SLURM_CONF=<dir>/slurm.conf (printed
# on the ready line), and the daemons listen on ports of their own (16817 and
# 16818, not Slurm's 6817 and 6818) and use a munged of their own, so that they
# never meet a Slurm or munge that was here before.
#
# The config is the smallest that runs under a sandboxed kernel (gVisor,
# Firecracker): no cgroups (proctrack/linuxproc, task/none), no accounting,
# MpiDefault=none (Slurm's default: tests ask for --mpi=pmi2 by name), one node
# named `hostname -s`, select/cons_tres on cores. A step of more tasks than CPUs
# runs with `srun --overcommit`.
#
# The node's CPUs, sockets, cores and threads are what `slurmd -C` reads from the
# hardware, never `nproc`: nproc counts the CPUs this process may run on, and a
# caller pinned to one CPU (a CI runner, a taskset) would write a one-CPU node on
# which every `srun -n 2` waits forever ("Requested partition configuration not
# available now"). For the same reason the daemons are started on every online
# CPU, and daemons found running with another node shape are restarted.
set -uo pipefail

DIR=${PYRO_DISTRIBUTED_SLURM_DIR:-/run/pyro-distributed-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=16817
SLURMD_PORT=16818
DAEMONS=(slurmd slurmctld munged) # the order in which they stop

STARTED= # set once this run has started daemons: a failure then stops them

fail() {
    echo "slurm: unavailable: $*"
    [[ -z "$STARTED" ]] || stop
    exit 1
}

# The last error (else the last line) of daemon NAME's log.
last_error() {
    local log=$DIR/$1.log line
    line=$(grep -E 'fatal|error' "$log" 2>/dev/null | tail -n 1)
    echo "${line:-$(tail -n 1 "$log" 2>/dev/null)}"
}

# Whether process PID is alive (not a zombie) and is NAME.
is() {
    local pid=$1 name=$2 state
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

# The pid in $DIR/NAME.pid, if that process is alive and is NAME.
running() {
    local name=$1 pid
    pid=$(cat "$DIR/$name.pid" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    is "$pid" "$name" || return 1
    echo "$pid"
}

# Stop the daemons named in pid files here. A daemon removes its own pid file
# as it begins to exit, so the wait is on the process, not on the file.
stop() {
    local name pid
    for name in "${DAEMONS[@]}"; do
        if pid=$(running "$name"); then
            kill -TERM "$pid" 2>/dev/null
            for _ in $(seq 50); do
                is "$pid" "$name" || break
                sleep 0.2
            done
            if is "$pid" "$name"; then
                kill -KILL "$pid" 2>/dev/null
                sleep 0.5
            fi
        fi
        rm -f "$DIR/$name.pid"
    done
}

# The daemons and the clients run as root (SlurmUser=root): no user to create.
[[ $(id -u) -eq 0 ]] || fail "not root (the daemons are started as root)"

# One run at a time (pytest-xdist's workers may each run it): the others wait,
# then find the daemons up. The daemons never inherit the lock (9>&-).
{ mkdir -p "$DIR" && exec 9>>"$DIR/lock"; } 2>/dev/null || fail "cannot create $DIR"
if command -v flock >/dev/null; then
    flock -w 180 9 || fail "another scripts/start_slurm.sh held $DIR/lock for 180 s"
fi

if [[ "${1:-}" == "stop" ]]; then
    stop
    echo "slurm: stopped"
    exit 0
fi

missing=()
for tool in munged slurmctld slurmd srun sinfo scontrol; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || fail "no ${missing[*]} and no apt-get to install them"
    log=${TMPDIR:-/tmp}/pyro-distributed-slurm-apt.log
    export DEBIAN_FRONTEND=noninteractive
    # The package lists only where apt knows no slurm-wlm yet.
    if ! apt-cache policy slurm-wlm 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        timeout 40 apt-get update -q >"$log" 2>&1 9>&- || fail "apt-get update failed ($log)"
    fi
    # ~10 s on a machine with a near mirror (Debian 12: Slurm 22.05).
    timeout 80 apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$log" 2>&1 9>&- ||
        fail "apt-get install slurm-wlm munge failed ($log)"
    for tool in "${missing[@]}"; do
        command -v "$tool" >/dev/null || fail "apt-get installed slurm-wlm but there is no $tool"
    done
fi

mkdir -p "$DIR"/state "$DIR"/spool "$DIR"/munge || fail "cannot create $DIR"
chmod 0755 "$DIR" "$DIR"/munge # munged wants its socket's directory open to all

node=$(hostname -s)
[[ -n "$node" ]] || fail "no host name (hostname -s is empty)"

# The node as slurmd sees the hardware: "CPUs=2 Boards=1 SocketsPerBoard=1 ...".
shape=$(timeout 20 slurmd -C 2>/dev/null | head -n 1 |
    grep -oE '(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=[0-9]+' | tr '\n' ' ')
[[ "$shape" == *CPUs=* ]] || fail "slurmd -C printed no CPUs"
shape=${shape% }

alive=0
for name in "${DAEMONS[@]}"; do
    running "$name" >/dev/null && alive=$((alive + 1))
done
# Daemons started from a config of another shape (an older version of this
# script counted nproc) are restarted.
grep -qF " $shape RealMemory=" "$CONF" 2>/dev/null || alive=0

if ((alive < ${#DAEMONS[@]})); then
    # Some or none are up: start all three afresh from a fresh config.
    stop
    memory=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    # Run on every online CPU (what the config promises), whatever the caller's
    # affinity; the daemons and their tasks inherit it. Where a cpuset forbids
    # that, the caller's affinity stays and the tasks share what it allows.
    online=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
    command -v taskset >/dev/null && taskset -p -c "0-$((online - 1))" $$ >/dev/null 2>&1
    cat >"$CONF" <<EOF
# Written by scripts/start_slurm.sh: a one-node Slurm for pyro-distributed's tests.
ClusterName=pyrodist
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=30
NodeName=$node NodeAddr=127.0.0.1 $shape RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    if [[ ! -s $DIR/munge/munge.key ]]; then
        (umask 077 && head -c 1024 /dev/urandom >"$DIR/munge/munge.key") ||
            fail "cannot write a munge key"
    fi
    export SLURM_CONF=$CONF
    STARTED=1
    # setsid and no inherited stdout: the daemons outlive this script and never
    # hold the pipe of whoever runs it (tests/slurm.py reads its output).
    # --force: munged refuses a root-owned key and socket directory without it.
    setsid munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munged.pid" --seed-file="$DIR/munge/munge.seed" \
        --log-file="$DIR/munged.log" </dev/null >/dev/null 2>&1 9>&- ||
        fail "munged did not start ($DIR/munged.log)"
    timeout 10 bash -c "until munge -S '$DIR/munge/munge.socket' -n </dev/null | \
        unmunge -S '$DIR/munge/munge.socket' >/dev/null 2>&1; do sleep 0.2; done" ||
        fail "munged does not answer ($DIR/munged.log)"
    # -c: no state from an earlier start (its jobs are gone with their daemons).
    setsid slurmctld -c </dev/null >/dev/null 2>&1 9>&- ||
        fail "slurmctld did not start ($(tail -n 1 "$DIR/slurmctld.log" 2>/dev/null))"
    setsid slurmd -N "$node" </dev/null >/dev/null 2>&1 9>&- ||
        fail "slurmd did not start ($(tail -n 1 "$DIR/slurmd.log" 2>/dev/null))"
fi

export SLURM_CONF=$CONF
# Until the node reports idle (or mixed/allocated: a step may be running
# already), within 30 s; a daemon that exited (a port taken, say) fails at once.
# The daemons write their pid files just after they detach: 5 s of grace.
started_at=$SECONDS
until state=$(timeout 15 sinfo -h -n "$node" -o %T 2>&1) &&
    [[ "$state" =~ ^(idle|mixed|allocated)$ ]]; do
    if ((SECONDS - started_at > 5)); then
        for name in slurmctld slurmd; do
            running "$name" >/dev/null || fail "$name exited: $(last_error "$name")"
        done
    fi
    if ((SECONDS - started_at > 30)); then
        fail "node $node not idle within 30 s (sinfo: ${state:-nothing}; logs in $DIR)"
    fi
    sleep 0.5
done
overcommit=()
[[ "$shape" =~ CPUs=([0-9]+) ]] && ((BASH_REMATCH[1] >= 2)) || overcommit=(--overcommit)
if ! out=$(timeout 30 srun -n 2 "${overcommit[@]}" --time=1 hostname 2>&1); then
    fail "srun -n 2 hostname failed: $(echo "$out" | tail -n 1)"
fi
[[ $(echo "$out" | grep -c .) -eq 2 ]] || fail "srun -n 2 hostname printed: $out"
echo "slurm: ready (SLURM_CONF=$CONF)"
