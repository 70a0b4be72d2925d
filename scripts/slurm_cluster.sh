#!/usr/bin/env bash
# A one-machine Slurm cluster (munged + slurmctld + slurmd, run by hand: no systemd needed),
# for trying hvd_sgp's Slurm launches (tests/test_slurm.py, mpi/README.md).
#
#   scripts/slurm_cluster.sh install   # root: apt-get the Debian packages (quick when present)
#   scripts/slurm_cluster.sh up        # root: start the daemons; prints  export SLURM_CONF=...
#   scripts/slurm_cluster.sh down      # cancel every job, stop the daemons
#
# Everything lives in $SLURM_CLUSTER_DIR (default /tmp/hvd-sgp-slurm): its own munge key and
# socket, slurm.conf, state, logs. Nothing in /etc is changed, so the Slurm commands find the
# cluster through SLURM_CONF. The node is this host (hostname -s) with SLURM_CLUSTER_CPUS CPUs
# (default 4, whatever the machine has: config_overrides lets 4 ranks run on 2 cores) in one
# partition, "debug", that oversubscribes; slurmctld listens on SLURM_CLUSTER_PORT (default
# 6817) and slurmd on the port after it.
set -euo pipefail

DIR="${SLURM_CLUSTER_DIR:-/tmp/hvd-sgp-slurm}"
CPUS="${SLURM_CLUSTER_CPUS:-4}"
CTLD_PORT="${SLURM_CLUSTER_PORT:-6817}"
NODE="$(hostname -s)"
CONF="$DIR/slurm.conf"
# Debian's PMIx plugin (mpi_pmix_v4.so) dlopens pmix2/lib/libpmix.so, which only libpmix-dev
# ships: without it `srun --mpi=pmix` fails with "can not load PMIx library".
PACKAGES=(slurm-wlm munge libpmix-dev)

die() { echo "slurm_cluster: $*" >&2; exit 1; }

# Wait up to $1 seconds for the command after it to succeed.
wait_for() {
    local seconds=$1; shift
    local end=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.2
    done
}

install() {
    [ "$(id -u)" -eq 0 ] || die "installing needs root"
    command -v apt-get >/dev/null || die "no apt-get: install ${PACKAGES[*]} another way"
    local package missing=()
    for package in "${PACKAGES[@]}"; do
        [ "$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null)" = installed ] \
            || missing+=("$package")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        timeout 300 apt-get update -qq
        timeout 600 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

write_conf() {
    cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: one node, root everywhere, no cgroups, no accounting.
ClusterName=hvdsgp
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

up() {
    [ "$(id -u)" -eq 0 ] || die "starting the daemons needs root"
    command -v slurmctld >/dev/null && command -v munged >/dev/null \
        || die "slurmctld or munged missing: run '$0 install' first"
    down >/dev/null 2>&1 || true
    mkdir -p "$DIR/state" "$DIR/spool"
    chmod 0755 "$DIR"
    if [ ! -s "$DIR/munge.key" ]; then
        dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
    fi
    chmod 0600 "$DIR/munge.key"
    write_conf
    munged --force --key-file="$DIR/munge.key" --socket="$DIR/munge.socket" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
    wait_for 10 munge -S "$DIR/munge.socket" -n || die "munged did not start: $DIR/munged.log"
    export SLURM_CONF="$CONF"
    # -i: ignore state left by an earlier cluster in $DIR (old jobs, a drained node).
    slurmctld -i -f "$CONF"
    wait_for 20 scontrol ping || die "slurmctld did not answer: $DIR/slurmctld.log"
    slurmd -f "$CONF"
    if ! wait_for 30 sh -c "sinfo -h -N -o %t | grep -Eq '^(idle|mix|alloc)'"; then
        sinfo -N -l >&2 || true
        die "the node did not become idle: $DIR/slurmd.log, $DIR/slurmctld.log"
    fi
    echo "export SLURM_CONF=$CONF"
}

# Stop the daemons whose pid files are given: SIGTERM, then SIGKILL after 2 s (slurmctld takes
# up to 7 s to save a state that is thrown away; no job is left when down() calls this).
stop() {
    local pidfile pid pids=()
    for pidfile in "$@"; do
        pid=$(cat "$pidfile" 2>/dev/null) || continue
        # Only the daemon the file names: after a crash its pid may belong to another process.
        if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$(basename "$pidfile" .pid)" ]; then
            pids+=("$pid")
        fi
    done
    [ "${#pids[@]}" -gt 0 ] || { rm -f "$@"; return 0; }
    kill "${pids[@]}" 2>/dev/null || true
    wait_for 2 sh -c "! { $(printf 'kill -0 %s 2>/dev/null || ' "${pids[@]}") false; }" \
        || kill -9 "${pids[@]}" 2>/dev/null || true
    wait_for 5 sh -c "! { $(printf 'kill -0 %s 2>/dev/null || ' "${pids[@]}") false; }" \
        || die "processes ${pids[*]} did not end"
    rm -f "$@"
}

down() {
    if [ -f "$CONF" ] && [ -s "$DIR/slurmctld.pid" ]; then
        export SLURM_CONF="$CONF"
        timeout 10 scancel --quiet --full --user=root 2>/dev/null || true
        wait_for 15 sh -c '[ -z "$(squeue -h -o %i)" ]' || true
    fi
    stop "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munged.pid"
}

case "${1:-}" in
    install) install ;;
    up) up ;;
    down) down ;;
    *) die "usage: $0 install|up|down   (state in \$SLURM_CLUSTER_DIR, now $DIR)" ;;
esac
