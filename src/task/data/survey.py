"""What one pass over image files found, said once: files that are not images (skipped), modes
converted to the trained channels, the files' own sizes against the trained size, and every
unreadable file. Failures are collected, not raised at the first, so the pass a job already
makes (decoding into memory, src.prepare's scan, src.predict) lists them all; the job then
refuses in one line, or leaves them out where ``data.skip_unreadable=true`` asks it to.

Lists go to files in the job's output folder (Hydra's), which a refused job keeps when it holds
them: a refused job's line names a file that is there to read."""

import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from lightning.pytorch.utilities import rank_zero_only
from lightning_exact import DataError
from PIL import Image

# What Pillow raises for a file it cannot decode (truncated, corrupt, not an image, too large).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
SKIP_KEY = "data.skip_unreadable"
SIZE_KEY = "data.image_size"
UNREADABLE_LIST = "unreadable.txt"
SKIPPED_LIST = "skipped_or_converted.txt"


class Findings:
    """One split's (or one predict job's) files as a pass decodes them. Each row is written by
    the one thread that decodes that file, so the decoding threads need no lock."""

    def __init__(self, files: Sequence[str], skipped: Sequence[str] = ()) -> None:
        self.files = files
        self.skipped = list(skipped)  # not image files (by extension): never decoded
        self.heights = np.zeros(len(files), np.int32)  # the file's own size; 0: unreadable
        self.widths = np.zeros(len(files), np.int32)
        self.modes: list[str | None] = [None] * len(files)  # Pillow's mode before conversion
        self.errors: dict[int, str] = {}

    def saw(self, i: int, height: int, width: int, mode: str) -> None:
        self.heights[i] = height
        self.widths[i] = width
        self.modes[i] = mode

    def failed(self, i: int, error: BaseException) -> None:
        self.errors[i] = f"{type(error).__name__}: {error}"

    def readable(self) -> np.ndarray:
        """Rows of the files that decoded, ascending."""
        return np.flatnonzero(self.heights > 0)


def output_folder() -> Path:
    """The job's output folder (Hydra's), or the system's temp folder outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(tempfile.mkdtemp(prefix="image-files-"))


@rank_zero_only
def say(line: str) -> None:
    print(line, flush=True)


@rank_zero_only
def write_list(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines))


def plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def own_sizes(findings: Mapping[str, Findings]) -> dict[str, list[int]] | None:
    """The smallest and largest height and width of the files that decoded (None: none did)."""
    heights = np.concatenate([f.heights[f.readable()] for f in findings.values()])
    widths = np.concatenate([f.widths[f.readable()] for f in findings.values()])
    if not len(heights):
        return None
    return {
        "min": [int(heights.min()), int(widths.min())],
        "max": [int(heights.max()), int(widths.max())],
    }


def size_note(
    sizes: Mapping[str, Sequence[int]] | None,
    size: Sequence[int],
    key: str | None = SIZE_KEY,
    again: str = "",
    set_by: str = "",
) -> str | None:
    """One line where the files' own sizes (:func:`own_sizes`) are not the trained size: what
    they are, what they are trained at, and the key that changes it (``key``: None where
    nothing can; ``set_by``: where it was set, ``again``: what else it takes, as shards do)."""
    height, width = size
    if sizes is None or list(sizes["min"]) == list(sizes["max"]) == [height, width]:
        return None
    low_h, low_w = sizes["min"]
    high_h, high_w = sizes["max"]
    if (low_h, low_w) == (high_h, high_w):
        own = f"{low_h}x{low_w}"
    else:
        own = f"{low_h}x{low_w} to {high_h}x{high_w} (heights {low_h}-{high_h}, "
        own += f"widths {low_w}-{high_w})"
    if key is None:
        trained = "the size the model was trained at"
        return f"Note: images are {own}; they are resized to {height}x{width}, {trained}"
    line = f"Note: images are {own}; training resizes them to {height}x{width} "
    line += f"({key}=[{height},{width}]{set_by})"
    if (low_h, low_w) == (high_h, high_w):
        return f"{line}; to train at their own size: {again}{key}=[{low_h},{low_w}]"
    return f"{line}; to train at another size: {again}{key}=[H,W]"


def skip_note(findings: Mapping[str, Findings], channels: int, where: Path) -> str | None:
    """One line counting the files skipped (not images) and converted (another mode), both
    listed in ``where``/skipped_or_converted.txt."""
    target = {1: "L", 3: "RGB"}[channels]
    listed = []
    kinds: Counter[str] = Counter()
    conversions: Counter[str] = Counter()
    for found in findings.values():
        for path in found.skipped:
            kind = Path(path).suffix.lower() or "no extension"
            kinds[kind] += 1
            listed.append(f"skipped\t{path}\tnot an image file ({kind})")
        for i, mode in enumerate(found.modes):
            if mode is not None and mode != target:
                conversions[f"{mode} to {target}"] += 1
                listed.append(f"converted\t{found.files[i]}\t{mode} to {target}")
    if not listed:
        return None
    parts = []
    if kinds:
        what = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        parts.append(f"{plural(sum(kinds.values()), 'file')} skipped (not images: {what})")
    if conversions:
        what = ", ".join(f"{n} {change}" for change, n in sorted(conversions.items()))
        parts.append(f"{plural(sum(conversions.values()), 'image')} converted ({what})")
    path = where / SKIPPED_LIST
    write_list(path, listed)
    return f"Note: {' and '.join(parts)}; listed in {path}"


def unreadable(
    findings: Mapping[str, Findings], skip: bool | None, where: Path
) -> dict[str, np.ndarray]:
    """The rows to keep per split. Unreadable files are listed in ``where``/unreadable.txt;
    then refused in one line (``skip`` False), left out and counted (True), or, where the job
    has no such setting (``skip`` None: src.predict), left out and counted."""
    bad = {name: f for name, f in findings.items() if f.errors}
    keep = {name: f.readable() for name, f in findings.items()}
    if not bad:
        return keep
    count = sum(len(f.errors) for f in bad.values())
    path = where / UNREADABLE_LIST
    lines = [f"{f.files[i]}\t{f.errors[i]}" for f in bad.values() for i in sorted(f.errors)]
    write_list(path, lines)
    per = ", ".join(f"{name} {len(f.errors)}" for name, f in bad.items())
    what = plural(count, "unreadable image file") + (f" ({per})" if len(findings) > 1 else "")
    if skip is False:
        raise DataError(
            f"{what}, listed in {path}; remove or replace them, or leave them out with "
            f"{SKIP_KEY}=true"
        )
    left = ", ".join(f"{len(rows):,} {name}" for name, rows in keep.items())  # "12 train"
    because = f" ({SKIP_KEY}=true)" if skip else ""
    say(f"Note: {what} left out{because}, listed in {path}; remaining: {left}")
    return keep


def said(
    findings: Mapping[str, Findings],
    size: Sequence[int],
    channels: int,
    skip: bool | None,
    size_key: str | None = SIZE_KEY,
    where: Path | None = None,
) -> dict[str, np.ndarray]:
    """Everything one pass found, in at most three lines (sizes, skipped and converted,
    unreadable); the rows to keep per split, or a DataError naming the unreadable files."""
    target = {1: "L", 3: "RGB"}[channels]
    to_list = any(
        f.skipped or f.errors or any(m not in (None, target) for m in f.modes)
        for f in findings.values()
    )
    listing = to_list and rank_zero_only.rank == 0  # the other ranks write nothing
    where = where or (output_folder() if listing else Path())
    notes = size_note(own_sizes(findings), size, size_key), skip_note(findings, channels, where)
    for line in notes:
        if line:
            say(line)
    return unreadable(findings, skip, where)
