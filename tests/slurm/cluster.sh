#!/usr/bin/env bash
# A throwaway SLURM cluster on this machine for the test suite: munge, slurmctld and two
# slurmd "nodes" (n1, n2) on 127.0.0.1, partitions debug (preemptible) and high. Needs
# root; installs Debian's slurm-wlm and munge when missing.   bash cluster.sh start | stop
# `install` only installs them (CI runs it before the suite, so no test waits on apt-get);
# without root or apt-get it says so and exits 0: the SLURM tests then skip, saying why.
set -euo pipefail
STATE=${FINETUNE_SLURM_STATE:-/tmp/finetune-slurm}
CONF=/etc/slurm/slurm.conf
NODES=2

# nodes ready, each counted once (sinfo -N lists a node once per partition)
up() { sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/ {print $1}' | sort -u | wc -l; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

installed() { command -v slurmctld >/dev/null && command -v munged >/dev/null; }

install_packages() {
  installed && return 0
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge >/dev/null
}

start() {
  install_packages
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  fi
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  mkdir -p "$STATE/log" "$STATE/ctld" "$STATE/spool"
  # cgroup proctrack when a v1 freezer is mounted (as on most clusters), else process groups
  if grep -qE '^cgroup /sys/fs/cgroup/freezer cgroup ' /proc/mounts; then track=cgroup; else track=pgid; fi
  host=$(hostname -s)
  cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc: it follows OMP_NUM_THREADS
  mem=$(( $(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) * 8 / 10 / NODES ))
  cat > "$STATE/slurm.conf" <<CONF
ClusterName=finetune-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# also the delay before a requeued job may start again (default 120 s)
AuthInfo=cred_expire=10
MailProg=/bin/true
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/$track
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=2,bf_interval=2
JobRequeue=1
ReturnToService=2
KillWait=10
# Jobs in 'debug' are preempted (requeued) by jobs in 'high'; at preemption SLURM sends
# the job's --signal, then SIGTERM after the partition's GraceTime.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
MinJobAge=600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-$((17000 + NODES))] CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=20
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF
  if [ "$track" = cgroup ]; then
    printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n' > "$STATE/cgroup.conf"
  else
    echo "# unused" > "$STATE/cgroup.conf"
  fi
  if ! cmp -s "$STATE/slurm.conf" "$CONF" || ! cmp -s "$STATE/cgroup.conf" /etc/slurm/cgroup.conf; then
    stop_daemons
    install -D -m 0644 "$STATE/slurm.conf" "$CONF"
    install -m 0644 "$STATE/cgroup.conf" /etc/slurm/cgroup.conf
  fi
  if ! alive "$STATE/slurmctld.pid"; then
    # Fresh state restarts job ids at 1: a step daemon left from an earlier cluster would
    # report its job 1 as finished and abort the new job 1.
    pkill -x slurmstepd 2>/dev/null || true
    rm -rf "${STATE:?}"/ctld/* "${STATE:?}"/spool/*
    slurmctld
  fi
  for i in $(seq "$NODES"); do
    alive "$STATE/slurmd-n$i.pid" || { mkdir -p "$STATE/spool/n$i"; slurmd -N "n$i"; }
  done
  for i in $(seq 120); do
    [ "$(up)" -ge "$NODES" ] && break
    [ $((i % 10)) = 0 ] && scontrol update nodename="n[1-$NODES]" state=resume 2>/dev/null || true
    sleep 0.5
  done
  [ "$(up)" -ge "$NODES" ] || { sinfo -N >&2; tail -5 "$STATE"/log/*.log >&2; echo "cluster did not come up" >&2; exit 1; }
  echo "slurm test cluster up: $(sinfo -h -o '%D nodes %T')"
}

stop_daemons() {
  if alive "$STATE/slurmctld.pid"; then
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// }" ]; then
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    scontrol shutdown >/dev/null 2>&1 || true
  fi
  for f in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid"; do
    [ -e "$f" ] || continue
    pid=$(cat "$f"); kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  # Step daemons (and a slurmd waiting on them) can outlive the controller, retrying their
  # last report forever. This cluster is the only SLURM on the machine: clear them.
  pkill -x slurmstepd 2>/dev/null || true
  pkill -x slurmd 2>/dev/null || true
  # (one name a call: pgrep matches at most 15 characters of a process name)
  for _ in $(seq 50); do pgrep -x slurmd >/dev/null || pgrep -x slurmstepd >/dev/null || break
    sleep 0.1; done
  pkill -9 -x slurmd 2>/dev/null || true
  pkill -9 -x slurmstepd 2>/dev/null || true
}

case "${1:-}" in
  install)
    if installed; then echo "slurm-wlm and munge: installed"
    elif [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
      echo "slurm-wlm and munge: not installed, and this needs root and apt-get (the SLURM tests will skip)"
    else install_packages && echo "slurm-wlm and munge: installed now"; fi ;;
  start) start ;;
  stop) stop_daemons; echo "slurm test cluster stopped" ;;
  *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
