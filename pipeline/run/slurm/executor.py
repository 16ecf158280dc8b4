"""The Slurm executor: the grid's (``pipeline.run.grid.GridExecutor``) on Slurm's engine, with what
only Slurm says of its nodes: the memory and GPUs a step can have in its partition, and which
nodes must see the run directory."""

from __future__ import annotations

import shutil

import pipeline.run.slurm.controller as controller
from pipeline.memory import MIB, Budget
from pipeline.run.executor import ExecutorError, StepOptions
from pipeline.run.grid import GridExecutor
from pipeline.run.slurm.engine import SlurmEngine
from pipeline.run.slurm.options import SlurmOptions


class SlurmExecutor(GridExecutor):
    """Runs attempts as Slurm jobs, through the cluster's own commands on this host's PATH."""

    name = "slurm"
    Options = SlurmOptions

    def __init__(self, options: SlurmOptions | None = None) -> None:
        self.options = options or SlurmOptions()
        for command in ("sbatch", "squeue", "scontrol", "scancel", "sinfo"):
            if shutil.which(command) is None:
                raise ExecutorError(
                    f"{command} is not on PATH: run eyrie where Slurm's commands are (a login node "
                    "of the cluster), or install the Slurm client"
                )
        super().__init__(SlurmEngine())

    def _partition(self, options: StepOptions | None) -> str:
        """A step's partition: its ``options``'s, else the pipeline's, else Slurm's default."""
        own = options.partition if isinstance(options, SlurmOptions) else None
        return own or self.options.partition or controller.default_partition()

    def memory_budget(self, options: StepOptions | None = None) -> Budget:
        """What one step can have: the largest node's memory in its partition. Slurm admits jobs by
        their --mem."""
        partition = self._partition(options)
        largest = max(node.memory_mib for node in controller.nodes_of({partition})) * MIB
        return Budget(
            available=largest,
            mem_total=largest,
            mem_available=largest,
            cgroup_version=None,
            binding=f"the largest node in Slurm's partition {partition}; the cluster admits steps by "
            "their --mem",
        )

    def gpu_capacity(self, options: StepOptions | None = None) -> tuple[int, str]:
        """The most GPUs one job can have: those of the node of its partition with the most (its
        Gres); and the words a refusal ends with."""
        partition = self._partition(options)
        gpus = max(node.gpus for node in controller.nodes_of({partition}))
        return gpus, f"a node of Slurm's partition {partition} has at most (its Gres)"

    def node_hosts(self, options: dict[str, StepOptions]) -> list[tuple[str, str]]:
        """The nodes of the steps' partitions (the default one for a step that names none)."""
        partitions = {o.partition if isinstance(o, SlurmOptions) else None for o in options.values()}
        return [(node.name, node.hostname) for node in controller.nodes_of(partitions)]
