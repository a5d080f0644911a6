"""``python -m src.eval ckpt_path=PATH [split=test|val]``: evaluate a checkpoint and report.

The steps: :func:`lightning_exact.job.stories.evaluate`."""

from lightning_exact.job.entry import main

from src.task import TASK

if __name__ == "__main__":
    main("eval", TASK)
