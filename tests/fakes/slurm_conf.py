"""The test cluster's slurm.conf and gres.conf (tests/fakes/slurm.py starts the daemons).

Three nodes on one host, told apart by port and `%n` in their spool, pid and log paths; auth goes
to the cluster's own munged (`AuthInfo=socket=`); a short `KillWait` the tests read back.
"""

from __future__ import annotations

from pathlib import Path

NODES = ("sd-n1", "sd-n2", "sd-n3")
GPUS_PER_NODE = 2
KILL_WAIT_S = 5

_SLURM_CONF = """\
ClusterName=spotdrain
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s): keep it short.
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={root}/state
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdSpoolDir={root}/spool/%n
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
# A requeued job waits for its BeginTime; only the periodic pass (default every 60 s) starts it.
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The nodes share this host's CPUs: trust slurm.conf over what each slurmd counts.
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
SlurmctldTimeout=10
MessageTimeout=5
KillWait={kill_wait}
JobRequeue=1
MinJobAge=600
GresTypes=gpu
"""


def write_conf(etc: Path, root: Path, host: str, ports: dict[str, int], munge_socket: Path) -> Path:
    """Write slurm.conf and gres.conf into etc; the slurm.conf path. ports: 'ctld' and each node's.
    The fake GPUs are root/dev/NODE-gpuN."""
    text = _SLURM_CONF.format(
        host=host,
        ctld_port=ports["ctld"],
        munge_socket=munge_socket,
        root=root,
        kill_wait=KILL_WAIT_S,
    )
    for node in NODES:
        text += (
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[node]} "
            f"CPUs=4 RealMemory=1000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN\n"
        )
    text += "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
    (etc / "slurm.conf").write_text(text)
    gres = "".join(
        f"NodeName={node} Name=gpu File={root}/dev/{node}-gpu[0-{GPUS_PER_NODE - 1}]\n"
        for node in NODES
    )
    (etc / "gres.conf").write_text(gres)
    return etc / "slurm.conf"
