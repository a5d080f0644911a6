"""``python -m src.train [overrides]``: fit, test the best checkpoint, report.

The steps: :func:`lightning_exact.job.stories.train`."""

from lightning_exact.job.entry import main

from src.task import TASK

if __name__ == "__main__":
    main("train", TASK)
