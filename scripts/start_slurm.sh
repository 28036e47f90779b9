#!/usr/bin/env bash
# Start a real one-node Slurm on this machine (Debian's slurm-wlm and munge), for
# the tests marked `slurm` (tests/support/slurm.py, tests/engines/test_slurm.py).
#
#   bash scripts/start_slurm.sh               # install if needed, start, check; idempotent
#   bash scripts/start_slurm.sh --for PID     # the same, on behalf of process PID (a test run)
#   bash scripts/start_slurm.sh release PID   # PID is done with them
#   bash scripts/start_slurm.sh stop          # stop the daemons this script started
#
# On success it prints one line, `slurm: ready (SLURM_CONF=...)`, and exits 0;
# otherwise one line `slurm: unavailable: WHY` and a non-zero exit. Every wait has
# a time-out: about 3 minutes at worst, with apt-get installing the packages.
#
# A test run's daemons stop with it. Each pytest process (tests/support/slurm.py) starts
# or finds the daemons `--for` its own pid and, as it exits, `release`s them.
# Daemons that such a start started are stopped by the release that leaves no
# live process holding them (a process that died without releasing holds
# nothing), so concurrent runs, and pytest-xdist's workers, share them until
# the last is done. Daemons that were running before (started without --for,
# or kept) are left running. PYRO_DISTRIBUTED_KEEP_SLURM=1, set for the test
# command (`PYRO_DISTRIBUTED_KEEP_SLURM=1 bash scripts/test.sh`), keeps the
# daemons it starts or finds for the next run, whose start then takes well
# under a second; `bash scripts/start_slurm.sh stop` stops them.
#
# Everything lives in a directory of its own, $PYRO_DISTRIBUTED_SLURM_DIR (default
# /run/pyro-distributed-slurm): the config, a munge key, munged's socket, the
# state, the logs and the pid files. /etc/slurm/slurm.conf is left alone, even
# when there is none: a file there would be read by every Slurm client on the
# machine and outlive these daemons, and where a site's Slurm is configured it
# must not be replaced. So the clients need SLURM_CONF=<dir>/slurm.conf (printed
# on the ready line), and the daemons listen on ports of their own (16817 and
# 16818, not Slurm's 6817 and 6818; PYRO_DISTRIBUTED_SLURM_PORT=P moves them to P
# and P+1, for a second Slurm beside the first) and use a munged of their own,
# so that they never meet a Slurm or munge that was here before.
#
# The config is the smallest that runs under a sandboxed kernel (gVisor,
# Firecracker): no cgroups (proctrack/linuxproc, task/none), no accounting,
# MpiDefault=none (Slurm's default: tests ask for --mpi=pmi2 by name), one node
# named `hostname -s`, select/cons_tres on cores. A step of more tasks than CPUs
# runs with `srun --overcommit`. MpiParams=ports=12000-12999 lets `srun
# --resv-ports` reserve ports for a step (SLURM_STEP_RESV_PORTS). Daemons found
# running from another config (an older version of this script) are restarted.
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
CTLD_PORT=${PYRO_DISTRIBUTED_SLURM_PORT:-16817}
SLURMD_PORT=$((CTLD_PORT + 1))
DAEMONS=(slurmd slurmctld munged) # the order in which they stop
USERS=$DIR/users             # a file per process that holds the daemons: its start time
STOP_WHEN_UNUSED=$DIR/stop-when-unused # there while the daemons are a test run's

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

# The start time of process PID, in ticks since boot (field 22 of its stat; the
# name before it may hold spaces): a pid reused by another process is not the
# same holder.
start_time() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    awk '{print $20}' <<<"$stat"
}

# Whether the holder written in file USER still lives.
holds() {
    local user=$1 pid
    pid=${user##*/}
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [[ "$(start_time "$pid")" == "$(cat "$user" 2>/dev/null)" ]]
}

# The daemons and the clients run as root (SlurmUser=root): no user to create.
[[ $(id -u) -eq 0 ]] || fail "not root (the daemons are started as root)"

# One run at a time (pytest-xdist's workers may each run it): the others wait,
# then find the daemons up. The daemons never inherit the lock (9>&-).
{ mkdir -p "$DIR" && exec 9>>"$DIR/lock"; } 2>/dev/null || fail "cannot create $DIR"
if command -v flock >/dev/null; then
    flock -w 180 9 || fail "another scripts/start_slurm.sh held $DIR/lock for 180 s"
fi

HOLDER=
case "${1:-}" in
stop)
    stop
    rm -rf "$USERS" "$STOP_WHEN_UNUSED"
    echo "slurm: stopped"
    exit 0
    ;;
release)
    [[ "${2:-}" =~ ^[0-9]+$ ]] || fail "release needs the pid that started them (release PID)"
    rm -f "$USERS/$2"
    left=0
    for user in "$USERS"/*; do
        [[ -e "$user" ]] || continue
        if holds "$user"; then left=$((left + 1)); else rm -f "$user"; fi
    done
    if ((left)); then
        echo "slurm: left running ($left other process(es) hold them)"
    elif [[ -e "$STOP_WHEN_UNUSED" ]]; then
        stop
        rm -f "$STOP_WHEN_UNUSED"
        echo "slurm: stopped"
    else
        echo "slurm: left running (they were running before the test run, or kept)"
    fi
    exit 0
    ;;
--for)
    [[ "${2:-}" =~ ^[0-9]+$ ]] && start_time "$2" >/dev/null ||
        fail "--for needs the pid of a live process (--for PID)"
    HOLDER=$2
    ;;
"") ;;
*) fail "unknown argument ${1} (none, --for PID, release PID or stop)" ;;
esac

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

memory=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
config="# Written by scripts/start_slurm.sh: a one-node Slurm for pyro-distributed's tests.
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
MpiParams=ports=12000-12999
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
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"

alive=0
for name in "${DAEMONS[@]}"; do
    running "$name" >/dev/null && alive=$((alive + 1))
done
# Daemons started from another config (another node shape, ports or settings)
# are restarted.
[[ "$(cat "$CONF" 2>/dev/null)" == "$config" ]] || alive=0

if ((alive < ${#DAEMONS[@]})); then
    # Some or none are up: start all three afresh from a fresh config.
    stop
    # Run on every online CPU (what the config promises), whatever the caller's
    # affinity; the daemons and their tasks inherit it. Where a cpuset forbids
    # that, the caller's affinity stays and the tasks share what it allows.
    online=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
    command -v taskset >/dev/null && taskset -p -c "0-$((online - 1))" $$ >/dev/null 2>&1
    printf '%s\n' "$config" >"$CONF"
    if [[ ! -s $DIR/munge/munge.key ]]; then
        (umask 077 && head -c 1024 /dev/urandom >"$DIR/munge/munge.key") ||
            fail "cannot write a munge key"
    fi
    export SLURM_CONF=$CONF
    STARTED=1
    # setsid and no inherited stdout: the daemons outlive this script and never
    # hold the pipe of whoever runs it (tests/support/slurm.py reads its output).
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
if [[ -n "$HOLDER" ]]; then
    mkdir -p "$USERS" && start_time "$HOLDER" >"$USERS/$HOLDER" ||
        fail "cannot record process $HOLDER in $USERS"
    # Daemons this start started are the run's, to stop after it; asked to keep
    # them, a run keeps them whoever started them.
    if [[ "${PYRO_DISTRIBUTED_KEEP_SLURM:-}" == 1 ]]; then
        rm -f "$STOP_WHEN_UNUSED"
    elif [[ -n "$STARTED" ]]; then
        touch "$STOP_WHEN_UNUSED"
    fi
elif [[ -n "$STARTED" ]]; then
    rm -f "$STOP_WHEN_UNUSED" # started by hand: running until stopped by hand
fi
echo "slurm: ready (SLURM_CONF=$CONF)"
