"""``python -m src.consolidate FOLDER``: write a sharded checkpoint folder (strategy=fsdp) as one
.ckpt file (:mod:`lightning_exact.checkpoints.consolidate`)."""

import sys

from lightning_exact.checkpoints.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
