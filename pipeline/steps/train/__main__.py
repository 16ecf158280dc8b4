"""A torchrun worker: ``python -m pipeline.steps.train CONFIG.json`` (started by ``eyrie train``)."""

import sys
from pathlib import Path

from pipeline.steps.train.launch import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(Path(sys.argv[1])))
