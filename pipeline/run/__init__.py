"""How steps run: the step spec, the executors, the ledger, the verdicts, the orchestrator."""

EXECUTORS: dict[str, str] = {
    "local": "pipeline.run.local:LocalExecutor",
    "docker": "pipeline.run.docker:DockerExecutor",
    "slurm": "pipeline.run.slurm:SlurmExecutor",
}
"""The executors by name (``--executor``, and the pipeline file's per-executor options): each
``module:class``, the module imported only when the executor or its options are needed
(``pipeline.run.executor.executor_class``). Kept here, free of imports, so that the command
line lists them without loading any executor."""
