"""``python -m src.sync OUTPUT_DIR``: send what a job could not send to its MLflow server
(:mod:`lightning_exact.tracking.sync`; ``--help`` says more)."""

import sys

from lightning_exact.tracking.sync import main

if __name__ == "__main__":
    sys.exit(main())
