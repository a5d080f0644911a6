"""``python -m src.register SWEEP_DIR --name NAME``: register the best job of a sweep, best in
the task's direction (:mod:`lightning_exact.tracking.register`)."""

import sys

from lightning_exact.tracking.register import main

from src.task import TASK

if __name__ == "__main__":
    sys.exit(main(TASK))
