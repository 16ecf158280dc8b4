"""The Slurm executor: each attempt is one Slurm job, submitted with ``sbatch``.

Slurm's own command-line tools, not a Python client: they are the interface
every cluster and release has (``sbatch --parsable``, ``squeue -o``,
``scontrol show job -o``, ``scancel``), as Nextflow drives Slurm. pyslurm binds
to libslurm and is built for one Slurm release at a time; submitit runs pickled
Python callables, not commands, and reads job states through ``sacct``, which
needs slurmdbd.

The job: ``--mem`` = the attempt's limit, ``--gres=gpu:N`` for ``gpus: N``, the
partition, account, CPUs and further sbatch arguments from the pipeline's
``slurm:`` options, the step's directory as working directory, and its output
and error in the attempt's log files, which the runner follows. The run
directory must be on a filesystem the nodes share (checked before anything
starts). The batch script runs the step under the wrapper a step container has
(``pipeline.run.container_init``): from inside the job it reads the job's own
cgroup — the OOM-kill counter before and after, the peak, the timeline, the
main process's exact wait status — and writes that report beside the logs,
because Slurm removes the job's cgroups when it ends.

Evidence, as for every executor, the report first:

- Slurm's final state (``scontrol show job`` while the controller remembers the
  job, else ``sacct``) says who stopped a job: its time limit (TIMEOUT), someone
  else's ``scancel`` (CANCELLED), preemption (PREEMPTED), a lost node
  (NODE_FAIL);
- where the report is missing, that state stands in for it: OUT_OF_MEMORY is an
  OOM kill (Slurm cannot say whose: it reports it as well when only a child was
  killed and the step exited 0), ExitCode its exit status or signal;
- MaxRSS is never read: Slurm samples it.

With ``nodes: N`` the batch script runs the step through ``srun``, one task per
node, each under the wrapper (one report per node), with torchrun's rendezvous
taken from Slurm's environment (the allocation's first node; a port from the
job id). The attempt's peak is then the largest node's, its OOM kills the sum,
and its exit status that of the node that failed first.

The runner watches its jobs with one ``squeue`` a second for all of them. A
step's ``timeout`` counts from the moment its job's script starts (Slurm creates
its log files first), not while it waits in the queue or its node sets it up;
``--time`` is set a minute beyond it, so that a job whose runner died still
ends. Steps run side by side as far as the cluster admits them.

Its parts: ``options`` (the pipeline file's ``slurm:``), ``script`` (the batch
script and the ``sbatch`` command line), ``controller`` (what the runner asks
Slurm, asked again while the controller is silent), ``engine`` (Slurm as the
grid's batch engine: submitting, never twice; Slurm's job states and final
states read as the grid's) and ``executor`` (what only Slurm says of its nodes:
the memory and GPUs a step can have, which nodes must see the run directory).
What any batch engine shares (watching all jobs in one call, following logs,
waiting for the in-job report on the shared filesystem, telling an attempt's
outcome from it, taking up or ending the jobs of a runner that died) is
``pipeline.run.grid``.
"""

from pipeline.run.slurm.controller import parse_exit_code, parse_job_record
from pipeline.run.slurm.engine import SlurmAttempt, SlurmEngine, squeue_watcher
from pipeline.run.slurm.executor import SlurmExecutor
from pipeline.run.slurm.options import SlurmOptions
from pipeline.run.slurm.script import batch_script, report_path, sbatch_argv

__all__ = [
    "SlurmAttempt",
    "SlurmEngine",
    "SlurmExecutor",
    "SlurmOptions",
    "batch_script",
    "parse_exit_code",
    "parse_job_record",
    "report_path",
    "sbatch_argv",
    "squeue_watcher",
]
