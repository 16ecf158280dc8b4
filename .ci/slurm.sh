# Sourced by .ci/run (as root, on a fresh Debian 12 machine): a real single-node
# Slurm cluster from Debian's packages (slurm-wlm 22.05, munge), with memory
# enforced through cgroups, for the slurm-marked tests. Safe to source twice:
# daemons that already answer are left as they are (after a change to the
# configuration below, stop them first: kill the pids in /run/eyrie-slurm*.pid).
#
# The node is this host; the run directories the tests use are therefore
# "shared" with it. Cores may be shared by up to 16 jobs (OverSubscribe=FORCE),
# memory may not: on 2 cores the scenario suite's steps still run side by side,
# admitted by their --mem, as they would be on a cluster.

_eyrie_slurm_setup() {
    export DEBIAN_FRONTEND=noninteractive
    local node memory_mib=8192 state=/var/lib/eyrie-slurm logs=/var/log/eyrie-slurm
    node="$(hostname -s)"

    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
        apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
    fi
    mkdir -p /etc/slurm "$state/ctld" "$state/d" "$logs"

    cat >/etc/slurm/slurm.conf <<EOF
ClusterName=eyrie-ci
SlurmctldHost=$node
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=/run/eyrie-slurmctld.pid
SlurmdPidFile=/run/eyrie-slurmd.pid
SlurmctldLogFile=$logs/slurmctld.log
SlurmdLogFile=$logs/slurmd.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/cgroup
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$logs/jobcomp.log
ReturnToService=2
KillWait=5
MinJobAge=600
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
NodeName=$node CPUs=$(nproc) RealMemory=$memory_mib State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:16 PriorityTier=2
# Jobs here are preempted (cancelled) by any job of debug that needs their memory.
PartitionName=low Nodes=$node MaxTime=INFINITE State=UP OverSubscribe=FORCE:16 PriorityTier=1
# A node on another host, never up: a run directory on this host's disk is refused for it.
NodeName=elsewhere01 NodeHostname=elsewhere01.invalid NodeAddr=127.0.0.1 Port=6899 CPUs=1 RealMemory=1024 State=DOWN Reason=never_up
PartitionName=elsewhere Nodes=elsewhere01 State=UP
EOF
    cat >/etc/slurm/cgroup.conf <<'EOF'
CgroupPlugin=cgroup/v1
ConstrainRAMSpace=yes
ConstrainSwapSpace=yes
AllowedSwapSpace=0
EOF

    if ! runuser -u munge -- munge -n >/dev/null 2>&1 || ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        runuser -u munge -- munged </dev/null >/dev/null 2>&1
    fi
    if ! scontrol ping 2>/dev/null | grep -q "is UP"; then
        slurmctld </dev/null >/dev/null 2>&1
    fi
    if ! pgrep -x slurmd >/dev/null; then
        slurmd </dev/null >/dev/null 2>&1
    fi

    local waited=0
    until sinfo -h -N -o "%T" 2>/dev/null | grep -qx "idle\|mixed\|allocated"; do
        if [ "$waited" -ge 60 ]; then
            echo "the Slurm node did not become idle within 60 s; see $logs:" >&2
            sinfo -N -l >&2 || true
            tail -n 20 "$logs/slurmctld.log" "$logs/slurmd.log" >&2 || true
            return 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    sinfo -N -o "%N %T %m MiB %c CPUs"
}

_eyrie_slurm_setup
# From here on a missing cluster fails the slurm-marked tests instead of skipping them.
export EYRIE_REQUIRE_SLURM=1
