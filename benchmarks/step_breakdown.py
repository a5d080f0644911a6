"""Where a training step's host time goes: ``python -m benchmarks.step_breakdown [overrides]``.

Runs ``python -m src.train`` (``--kind template``; or ``bare``: a bare Lightning ``Trainer``
over the same module; or ``raw``: the hand-written loop of :mod:`benchmarks.step_overhead`) in
this process with timers around the parts of a step: the data fetch, the module's
forward, loss, metric updates and ``self.log`` calls, backward, the optimizer's math,
``zero_grad``, Lightning's logger connector (its result collection), each callback's batch
hooks and the logger. Each part's time is exclusive (the parts it calls are its own rows); what
no timer covers is Lightning's loop, closure and hook dispatch. Printed as ms per step over the
steps after ``--warmup``, in CPU time of the main thread (``--wall``: wall time), so other
processes on a shared machine blur the figures less (torch's intra-op threads are not counted:
run it with ``OMP_NUM_THREADS=1``, which the tiny network does not need). A wrapper costs about
a microsecond per call, so the total is a little above the un-instrumented time.
"""

import argparse
import functools
import sys
import time
from collections import defaultdict

from benchmarks import step_overhead

clock = time.thread_time  # CPU time of the main thread: what other processes take is not counted
totals: dict[str, float] = defaultdict(float)
stack: list[list[float]] = []  # [start, time of timed callees]
recording = False


def timed(name: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not recording:
            return function(*args, **kwargs)
        frame = [clock(), 0.0]
        stack.append(frame)
        try:
            return function(*args, **kwargs)
        finally:
            stack.pop()
            elapsed = clock() - frame[0]
            totals[name] += elapsed - frame[1]
            if stack:
                stack[-1][1] += elapsed

    wrapper.__wrapped_by_breakdown__ = True
    return wrapper


def patch(owner, attribute: str, name: str) -> None:
    function = getattr(owner, attribute)
    if not getattr(function, "__wrapped_by_breakdown__", False):
        setattr(owner, attribute, timed(name, function))


def instrument() -> None:
    import lightning.pytorch as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.loops.optimization.automatic import Closure
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import (
        _LoggerConnector,
    )
    from torch.utils.data import dataloader
    from torchmetrics import Metric

    from src.task.model import ImageClassifier

    patch(dataloader._BaseDataLoaderIter, "__next__", "data fetch (loader)")
    patch(ImageClassifier, "forward", "module forward")
    patch(F, "cross_entropy", "loss")
    patch(L.LightningModule, "log", "self.log")
    patch(torch.Tensor, "backward", "backward")
    patch(sys.modules["torch.optim.adam"], "adam", "optimizer math")
    patch(torch.optim.Optimizer, "zero_grad", "zero_grad")
    patch(torch.optim.Adam, "step", "optimizer.step wrappers (hooks, grad mode, state)")
    patch(Closure, "__call__", "Lightning closure (own code)")
    patch(ImageClassifier, "training_step", "training_step (own code)")
    for method in ("on_batch_start", "on_batch_end", "update_train_step_metrics"):
        patch(_LoggerConnector, method, "logger connector (result collection)")
    original_init = Metric.__init__

    def init(self, *args, **kwargs):  # update() is wrapped per instance by torchmetrics
        original_init(self, *args, **kwargs)
        self.update = timed("metric update (torchmetrics)", self.update)

    Metric.__init__ = init

    # Every callback's batch hooks, named by its class.
    def callback_hooks():
        from lightning.pytorch.trainer import call

        original = call._call_callback_hooks

        @functools.wraps(original)
        def dispatch(trainer, hook_name, *args, **kwargs):
            if hook_name in ("on_train_batch_start", "on_train_batch_end"):
                for callback in trainer.callbacks:
                    hook = getattr(callback, hook_name)
                    if not getattr(hook, "__wrapped_by_breakdown__", False):
                        setattr(callback, hook_name, timed(type(callback).__name__, hook))
            return original(trainer, hook_name, *args, **kwargs)

        call._call_callback_hooks = timed("Lightning callback hook dispatch", dispatch)

    callback_hooks()


def start_recording() -> None:
    global recording
    totals.clear()
    recording = True


class Clock(step_overhead.Clock):
    def step_end(self, index: int) -> None:
        if index == self.warmup - 1:
            start_recording()
            self.start = clock()
        elif index == self.warmup + self.steps - 1:
            ms = 1000 * (clock() - self.start) / self.steps
            report(ms, self.steps)
            import os

            os._exit(0)


def report(ms: float, steps: int) -> None:
    rows = {name: 1000 * seconds / steps for name, seconds in totals.items()}
    rows["Lightning loop, closure, hook dispatch (untimed rest)"] = ms - sum(rows.values())
    width = max(map(len, rows))
    print(f"{'per training step':<{width}}  ms")
    for name, value in sorted(rows.items(), key=lambda item: -item[1]):
        print(f"{name:<{width}}  {value:6.3f}")
    print(f"{'total':<{width}}  {ms:6.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kind",
        choices=step_overhead.KINDS,
        default="template",
        help="raw loop, bare L.Trainer or src.train (default)",
    )
    parser.add_argument("--wall", action="store_true", help="wall time, not main-thread CPU time")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--workdir", default=".")
    parser.add_argument("overrides", nargs="*", help="src.train overrides (data, network, ...)")
    args = parser.parse_intermixed_args()
    limit = f"trainer.limit_train_batches={args.warmup + args.steps + 5}"
    args.overrides = [*args.overrides, "trainer.max_epochs=1", limit]
    if args.wall:
        global clock
        clock = time.perf_counter
    instrument()
    step_clock = Clock(args.warmup, args.steps)
    {
        "raw": step_overhead.run_raw,
        "bare": step_overhead.run_bare,
        "template": step_overhead.run_template,
    }[args.kind](args, step_clock)
    sys.exit("the run ended before the timed steps")


if __name__ == "__main__":
    main()
