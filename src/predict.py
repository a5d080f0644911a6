"""``python -m src.predict ckpt_path=PATH [split=test|val|train]``: write a predictions CSV.

The steps: :func:`lightning_exact.job.stories.predict`."""

from lightning_exact.job.entry import main

from src.task import TASK

if __name__ == "__main__":
    main("predict", TASK)
