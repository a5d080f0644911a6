#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try the SLURM path on a workstation (and for the
# tests that use a live cluster). Debian/Ubuntu, as root. Idempotent: run it again any time.
#
#   sudo bash slurm/local-cluster.sh        # then: sinfo, sbatch slurm/train.sbatch ...
#
# The node offers CPUS (default 4) CPUs whatever the machine has (SlurmdParameters=
# config_overrides), so a 2-core machine can run a 4-task job. No cgroups, no accounting.
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
mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
cat > "$CONF.new" <<CONFIG
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
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
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
KillWait=10
NodeName=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONFIG
restart=0
if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
  mv "$CONF.new" "$CONF"
  restart=1
else
  rm "$CONF.new"
fi

running() { pgrep -x "$1" >/dev/null; }
if [ "$restart" = 1 ]; then
  pkill -x slurmd || true
  pkill -x slurmctld || true
  sleep 1
fi
running slurmctld || slurmctld
running slurmd || slurmd

# Wait until the node takes jobs.
for _ in $(seq 60); do
  state="$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)"
  case "$state" in
    idle*|mix*|alloc*) echo "SLURM cluster up: node $HOST ($CPUS CPUs), partition local"; exit 0 ;;
    down*|drain*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 1
done
echo "Error: the SLURM node did not come up; see /var/log/slurm/slurmd.log and slurmctld.log" >&2
exit 1
