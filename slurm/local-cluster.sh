#!/usr/bin/env bash
# A SLURM cluster on this machine, to try the SLURM path on a workstation (and for the tests that
# use a live cluster). Debian/Ubuntu, as root. Idempotent: run it again any time.
#
#   sudo bash slurm/local-cluster.sh        # then: sinfo, sbatch slurm/train.sbatch ...
#
# Two nodes, both this machine: one named after it, one named localhost (both names resolve
# here), each with its own slurmd, so multi-node jobs (--nodes=2) run too. Each node offers CPUS
# (default 4) CPUs whatever the machine has (SlurmdParameters=config_overrides), so a 2-core
# machine can run a 4-task job. No cgroups, no accounting.
set -euo pipefail
CPUS="${CPUS:-4}"
HOST="$(hostname -s)"
CONF=/etc/slurm/slurm.conf

if [ "$(id -u)" != 0 ]; then
  echo "Error: run as root (it installs packages and starts the SLURM daemons)" >&2
  exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "Error: slurmctld/munged are missing and there is no apt-get to install them" >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi

# munge: the key SLURM signs its messages with, and its daemon, run as the munge user.
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
if ! munge -n </dev/null >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
fi

# A minimal configuration: one node, one partition, processes tracked without cgroups.
NODES=("$HOST" localhost)
mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/log/slurm
for node in "${NODES[@]}"; do mkdir -p "/var/lib/slurm/slurmd-$node"; done
cat > "$CONF.new" <<CONFIG
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
# A requeued job may start again cred_expire + 1 s later (default 120), and pending jobs are
# looked at every sched_interval s (default 60): ~12 s in all, on a workstation.
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
ReturnToService=2
JobRequeue=1
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd-%n
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
KillWait=10
NodeName=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=$CPUS State=UNKNOWN
NodeName=localhost NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONFIG
restart=0
if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
  mv "$CONF.new" "$CONF"
  restart=1
else
  rm "$CONF.new"
fi

if [ "$restart" = 1 ]; then
  pkill -x slurmd || true
  pkill -x slurmctld || true
  while pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null; do sleep 0.2; done
  rm -rf /var/lib/slurm/slurmctld/*  # the state of a previous configuration
fi
pgrep -x slurmctld >/dev/null || slurmctld
for node in "${NODES[@]}"; do
  pgrep -f "^slurmd -N $node\$" >/dev/null || slurmd -N "$node"
done

# Wait until both nodes take jobs.
for _ in $(seq 60); do
  states="$(sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ')"
  case "$states" in
    "idle "|"mix "|"alloc "|"idle mix "|"alloc idle "|"alloc mix "|"alloc idle mix ")
      echo "SLURM cluster up: nodes $HOST and localhost ($CPUS CPUs each), partition local"
      exit 0 ;;
    *down*|*drain*)
      for node in "${NODES[@]}"; do scontrol update nodename="$node" state=resume 2>/dev/null || true; done ;;
  esac
  sleep 1
done
echo "Error: the SLURM nodes did not come up; see /var/log/slurm/slurmd-*.log and slurmctld.log" >&2
exit 1
