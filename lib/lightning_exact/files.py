"""Files written whole or not at all: a reader (another rank, a job run again) or a crash sees
the old file or the new one, never part of one; folders made for work that fails, removed."""

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``write`` to a temporary file beside ``path``, fsync, rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with temp.open("xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)  # the rename itself survives a power loss


def fsync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (the renames in it) to disk."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def write_text_atomically(path: Path, text: str) -> None:
    """The small files a job run again reads back (its sweep record, its run id): a kill in
    mid-write must not leave half of one."""
    write_atomically(path, lambda file: file.write(text.encode()))


def copy_atomically(source: Path, target: Path) -> None:
    """``source`` to ``target`` unless already copied (same size and time, as copystat keeps)."""
    old = source.stat()
    new = target.stat() if target.is_file() else None
    if new and (old.st_size, old.st_mtime_ns) == (new.st_size, new.st_mtime_ns):
        return
    with source.open("rb") as file:
        write_atomically(target, lambda out: shutil.copyfileobj(file, out))
    shutil.copystat(source, target)


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist, innermost first."""
    missing = []
    current = Path(os.path.abspath(folder))
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    return missing


@contextmanager
def folder_kept_if_used(folder: Path) -> Iterator[None]:
    """Create ``folder`` (and its missing parents) for the block; if the block fails, remove
    those of them it created that are still empty: a mistyped path (``data.root=/nonexistent/
    data``) refused by the work it was made for leaves the filesystem as it was."""
    created = missing_folders(folder)
    Path(os.path.abspath(folder)).mkdir(parents=True, exist_ok=True)  # what `created` lists
    try:
        yield
    except BaseException:
        for path in created:
            with suppress(OSError):  # not empty: something else, or a finished file, is there
                path.rmdir()
        raise
