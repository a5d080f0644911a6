"""Temporary changes to what the process runs with: environment variables and log levels."""

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the block, then restore them as they were."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.update({key: value for key, value in before.items() if value is not None})
        for key in [key for key, value in before.items() if value is None]:
            os.environ.pop(key, None)


@contextmanager
def quiet(logger_name: str) -> Iterator[None]:
    """Silence a logger's INFO lines for the block."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
