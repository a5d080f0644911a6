"""Test instrument: counts Python-level ``torch.distributed`` collectives per training step.

Put this folder on ``PYTHONPATH`` and set ``COUNT_COLLECTIVES=<folder>``: every rank writes
``<folder>/rank<N>.json``, a list of ``[epoch, batch_idx, collectives]``: the collectives a rank
called from the start of that batch's ``training_step`` to the start of the next one (its end of
step hooks, Lightning's loop bookkeeping, the next step's start, and the backward in between). A
collective that calls another (``all_gather_object`` calls ``all_gather``) counts once. Torch's
functional collectives (``torch.ops._c10d_functional``: what the global-batch BatchNorm gathers
with, forward and backward) count too.
"""

import atexit
import functools
import json
import os
from pathlib import Path

TARGET = "src.task"  # its TASK names the model class
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)

FUNCTIONAL = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
)

steps: list[list[int]] = []  # [epoch, batch_idx, collectives since that step started]
state = {"depth": 0, "rank": None}


def count_collectives() -> None:
    import torch
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def counted(*args, __original=original, **kwargs):
            if state["depth"] == 0 and steps:
                steps[-1][2] += 1
            state["depth"] += 1
            try:
                return __original(*args, **kwargs)
            finally:
                state["depth"] -= 1

        setattr(dist, name, counted)
    for name in FUNCTIONAL:
        setattr(
            torch.ops._c10d_functional, name, Counted(getattr(torch.ops._c10d_functional, name))
        )


class Counted:
    """A functional collective (an op packet), counted when called; its overloads as they are."""

    def __init__(self, packet) -> None:
        self.packet = packet

    def __call__(self, *args, **kwargs):
        if state["depth"] == 0 and steps:
            steps[-1][2] += 1
        state["depth"] += 1  # a torch function mode re-calls the packet itself: one collective
        try:
            return self.packet(*args, **kwargs)
        finally:
            state["depth"] -= 1

    def __getattr__(self, name: str):
        return getattr(self.packet, name)


def mark_steps(module) -> None:
    original = module.TASK.model_class.training_step

    def training_step(self, batch, batch_idx):
        state["rank"] = self.trainer.global_rank
        steps.append([self.current_epoch, batch_idx, 0])
        return original(self, batch, batch_idx)

    module.TASK.model_class.training_step = training_step


def write() -> None:
    if state["rank"] is not None:
        folder = Path(os.environ["COUNT_COLLECTIVES"])
        (folder / f"rank{state['rank']}.json").write_text(json.dumps(steps))


if os.environ.get("COUNT_COLLECTIVES"):
    from lightning_exact.testing.instruments.patch_after_import import patch_after_import

    count_collectives()
    patch_after_import(TARGET, mark_steps)
    atexit.register(write)
