"""``python -m lightning_exact.server COMMAND ...``: ``bash tracking.sh COMMAND ...``."""

import os
import sys

from lightning_exact.server import SCRIPT

if __name__ == "__main__":
    os.execvp("bash", ["bash", str(SCRIPT), *sys.argv[1:]])
