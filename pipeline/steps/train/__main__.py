"""A torchrun worker: ``python -m pipeline.steps.train CONFIG.json`` (started by ``eyrie train``)."""

import sys
from pathlib import Path

from pipeline.steps.train.cli import worker
from pipeline.steps.train.train import TrainConfig

if __name__ == "__main__":
    sys.exit(worker(TrainConfig.model_validate_json(Path(sys.argv[1]).read_text())))
