"""Exact training at any world size: ``devices=N`` trains the weights ``devices=1`` trains.

Ranks already share the global batches (:class:`~src.template.resume.GlobalBatchSampler`) and
DDP averages their gradients; what still depended on the rank were the layers whose training
forward looks at the batch a process holds. :func:`make_exact` turns them, when the model is
built and in place (as torch's ``convert_sync_batchnorm`` does, but keeping each layer's class
as a base, its parameters, buffers and state-dict keys), into global-batch layers:

* BatchNorm normalises with the statistics of the global batch, forward and backward, and its
  running statistics follow them: the same on every rank and as one process's. On GPUs torch's
  own SyncBatchNorm does it; elsewhere (CPU, gloo) one all-gather per layer of each rank's
  [mean, variance, count], whose backward (a reduce-scatter of their gradients) is autograd's.
* Dropout draws the mask of the whole global batch from the step's seed (the same on every rank:
  :class:`~src.template.resume.SeedEachBatch`) and keeps this rank's rows, so a sample's mask
  depends on the seed, the step and its place in the global batch, never on the rank.

In evaluation mode, or in one process, each layer runs its torch class's own forward. A layer it
cannot make exact (a random op of its own, a normalisation over the batch it does not know) is
named by :func:`inexact_layers`.
"""

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import TorchDispatchMode

from src.template.private import SyncBatchNormFunction, differentiable_all_gather

# Devices where torch's SyncBatchNorm runs (it refuses CPU tensors).
SYNC_BATCH_NORM_DEVICES = ("cuda", "xpu")
SELU_ALPHA = 1.7580993408473766  # SELU's alpha x scale: alpha dropout's value of a dropped unit


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks training together: (0, 1) without a group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm over the global batch: the batches of every rank normalised as one."""

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:  # evaluation, export: torch's own, nothing distributed
            return super().forward(input)
        _, world = rank_and_world()
        if world == 1:
            return super().forward(input)
        self._check_input_dim(input)
        momentum = self.momentum_of_this_step()
        tracked = self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if input.device.type in SYNC_BATCH_NORM_DEVICES:
            return SyncBatchNormFunction.apply(
                input,
                self.weight,
                self.bias,
                running_mean,
                running_var,
                self.eps,
                momentum,
                dist.group.WORLD,
                world,
            )
        return gathered_batch_norm(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum
        )

    def momentum_of_this_step(self) -> float:
        """The running statistics' update factor, this step counted, as ``_BatchNorm`` has it."""
        if not self.track_running_stats or self.num_batches_tracked is None:
            return 0.0 if self.momentum is None else self.momentum
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # a cumulative average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum


def gathered_batch_norm(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    eps: float,
    momentum: float,
) -> Tensor:
    """``F.batch_norm`` in training mode over the batches of every rank together, its backward
    autograd's (:func:`global_mean_and_variance`)."""
    shape = [1, input.shape[1], *[1] * (input.dim() - 2)]
    values = input if input.dtype in (torch.float32, torch.float64) else input.float()
    mean, var, total = global_mean_and_variance(values)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            unbiased = var * total / (total - 1).clamp_min(1)
            running_var.lerp_(unbiased.to(running_var.dtype), momentum)
    # input * scale + shift, as torch's CPU BatchNorm computes it: one pass, forward and backward.
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale if bias is None else bias - mean * scale
    return torch.addcmul(shift.view(shape), values, scale.view(shape)).to(input.dtype)


def global_mean_and_variance(values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The per-channel mean and (biased) variance of every rank's ``values`` together, and their
    count. Each rank's are gathered by one differentiable all-gather (its backward
    reduce-scatters their gradients) and combined as torch's SyncBatchNorm combines them (Chan
    et al.'s pooled variance): as precise as one process's BatchNorm."""
    channels = values.shape[1]
    dims = [0, *range(2, values.dim())]
    count = values.numel() / channels
    # Two passes, as precise as torch's BatchNorm: on the CPU several times faster than
    # torch.var_mean, forward and backward (as x * x is than x.square(), and x + -m than x - m:
    # their backward passes over the whole batch once less).
    mean = values.sum(dims) / count
    centred = values + (-mean).view(1, channels, *[1] * (values.dim() - 2))
    variance = (centred * centred).sum(dims) / count
    local = torch.stack([mean, variance, torch.full_like(mean, count)])
    gathered = differentiable_all_gather(local, 0, dist.group.WORLD).view(-1, 3, channels)
    means, variances, counts = gathered.unbind(1)  # each [ranks, channels]
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total
    variance = (counts * (variances + (means - mean).square())).sum(0) / total
    return mean, variance, total


class GlobalBatchNorm1d(GlobalBatchNorm, nn.BatchNorm1d):
    pass


class GlobalBatchNorm2d(GlobalBatchNorm, nn.BatchNorm2d):
    pass


class GlobalBatchNorm3d(GlobalBatchNorm, nn.BatchNorm3d):
    pass


class GlobalDropoutNd(_DropoutNd):
    """Dropout whose mask is drawn for the global batch and sliced to this rank's rows: the
    global batch's rows ``[rank * b, (rank + 1) * b)`` are this rank's ``b`` samples."""

    per_channel = False  # one draw per channel map (Dropout1d/2d/3d, FeatureAlphaDropout)
    alpha = False  # SELU's self-normalising dropout (AlphaDropout, FeatureAlphaDropout)
    batch_dims: int | None = None  # the input's dimensions with a batch (Dropout1d/2d/3d)

    def forward(self, input: Tensor) -> Tensor:
        unbatched = self.batch_dims is not None and input.dim() != self.batch_dims
        if not self.training or not 0 < self.p < 1 or unbatched:
            return super().forward(input)  # nothing drawn
        keep = global_mask(input, self.p, self.per_channel)
        if self.alpha:
            scale = 1 / math.sqrt((SELU_ALPHA**2 * self.p + 1) * (1 - self.p))
            dropped = (keep - 1) * (SELU_ALPHA * scale) + SELU_ALPHA * scale * self.p
            return input * (keep * scale) + dropped
        keep = keep.div_(1 - self.p)
        return input.mul_(keep) if self.inplace else input * keep


def global_mask(input: Tensor, p: float, per_channel: bool) -> Tensor:
    """1 (kept) or 0 for each value (or channel map) of this rank's rows of ``input``, drawn for
    the whole global batch: the same number of draws on every rank, whatever its rank."""
    rank, world = rank_and_world()
    rows = input.shape[0]
    tail = (input.shape[1], *[1] * (input.dim() - 2)) if per_channel else input.shape[1:]
    mask = input.new_empty((rows * world, *tail)).bernoulli_(1 - p)
    return mask[rank * rows : (rank + 1) * rows]


class GlobalDropout(GlobalDropoutNd, nn.Dropout):
    pass


class GlobalDropout1d(GlobalDropoutNd, nn.Dropout1d):
    per_channel = True
    batch_dims = 3


class GlobalDropout2d(GlobalDropoutNd, nn.Dropout2d):
    per_channel = True
    batch_dims = 4


class GlobalDropout3d(GlobalDropoutNd, nn.Dropout3d):
    per_channel = True
    batch_dims = 5


class GlobalAlphaDropout(GlobalDropoutNd, nn.AlphaDropout):
    alpha = True


class GlobalFeatureAlphaDropout(GlobalDropoutNd, nn.FeatureAlphaDropout):
    per_channel = True
    alpha = True


# torch's layer -> its global-batch kind. Only these exact classes: a subclass may have changed
# what its forward does, so it is named (inexact_layers), not converted.
GLOBAL_KINDS: dict[type[nn.Module], type[nn.Module]] = {
    nn.BatchNorm1d: GlobalBatchNorm1d,
    nn.BatchNorm2d: GlobalBatchNorm2d,
    nn.BatchNorm3d: GlobalBatchNorm3d,
    nn.Dropout: GlobalDropout,
    nn.Dropout1d: GlobalDropout1d,
    nn.Dropout2d: GlobalDropout2d,
    nn.Dropout3d: GlobalDropout3d,
    nn.AlphaDropout: GlobalAlphaDropout,
    nn.FeatureAlphaDropout: GlobalFeatureAlphaDropout,
}
EXACT = (GlobalBatchNorm, GlobalDropoutNd, nn.SyncBatchNorm)  # SyncBatchNorm: GPUs, already global


def make_exact(model: nn.Module) -> nn.Module:
    """Each of ``model``'s torch BatchNorm and dropout layers made its global-batch kind, in
    place: the same object, a subclass of its class (``isinstance`` checks still hold)."""
    for module in model.modules():
        if (kind := GLOBAL_KINDS.get(type(module))) is not None:
            module.__class__ = kind
    return model


@rank_zero_only
def name_inexact_layers(model: nn.Module) -> None:
    """One warning at start naming each layer of ``model`` left to differ with the world size
    (:func:`inexact_layers`), by rank 0 (its trial forward too)."""
    if layers := inexact_layers(model):
        rank_zero_warn(
            f"strategy.exact: {len(layers)} layer(s) train differently on N ranks than on one: "
            f"{'; '.join(layers)} (docs/make-it-yours.md, step 2)"
        )


def inexact_layers(model: nn.Module) -> list[str]:
    """``path (Type: why)`` of each layer of ``model`` that trains differently on N ranks than on
    one: a normalisation with running statistics or a dropout left as it was (a subclass, a kind
    the template does not know) and, where the model has an ``example_input_array``, a layer
    whose training forward draws random numbers outside the global-batch layers."""
    found = {name: why for name, module in model.named_modules() if (why := why_inexact(module))}
    for name, op in random_ops_in_forward(model).items():
        found.setdefault(name, f"draws random numbers in its forward: {op}")
    return [
        f"{name or 'the model'} ({type(model.get_submodule(name)).__name__}: {why})"
        for name, why in found.items()
    ]


def why_inexact(module: nn.Module) -> str | None:
    """Why ``module`` differs with the world size, by its kind; ``None`` if it does not."""
    if isinstance(module, _BatchNorm) and not module.track_running_stats:
        return "it normalises evaluation batches by their own statistics"
    if isinstance(module, EXACT):
        return None
    if {"running_mean", "running_var"} & {key for key, _ in module.named_buffers(recurse=False)}:
        return "running statistics of each rank's batch"
    if isinstance(module, _DropoutNd) and module.p > 0:
        return "a dropout kind drawn per rank"
    return None


RANDOM = torch.Tag.nondeterministic_seeded  # the tag of every aten op that draws numbers


class RandomOps(TorchDispatchMode):
    """Notes each aten op that draws random numbers, by the innermost module running it."""

    def __init__(self, running: list[nn.Module]) -> None:
        super().__init__()
        self.running = running
        self.found: dict[nn.Module, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        innermost = self.running[-1] if self.running else None
        # A global-batch dropout's draws are exact; any other module's are not.
        of_its_own = innermost is not None and not isinstance(innermost, GlobalDropoutNd)
        if RANDOM in func.tags and of_its_own:
            self.found.setdefault(innermost, str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def random_ops_in_forward(model: nn.Module) -> dict[str, str]:
    """The random op each module of ``model`` draws itself in a trial training forward on its
    ``example_input_array`` (twice over: a batch of 2), by module path; the model is left as it
    was (modes, buffers, random state). Nothing without an example, or one it fails on."""
    example = getattr(model, "example_input_array", None)
    tensors = [*model.parameters(), *model.buffers()]
    if example is None or any(is_lazy(tensor) for tensor in tensors):  # shapes not known yet
        return {}
    names = {module: name for name, module in model.named_modules()}
    with ExitStack() as scope:
        scope.enter_context(trial_mode(model))
        scope.enter_context(torch.random.fork_rng(devices=[]))
        scope.enter_context(torch.no_grad())
        scope.enter_context(torch.compiler.set_stance("force_eager"))
        ops = scope.enter_context(RandomOps(scope.enter_context(running_modules(model))))
        try:
            call_with(model, example)
        except Exception:  # noqa: BLE001 - a model that cannot run its example is not checked
            return {}
    return {names[module]: op for module, op in ops.found.items()}


def call_with(model: nn.Module, example: Any) -> None:
    """``model`` called on ``example`` as Lightning's model summary calls it."""
    if isinstance(example, Tensor):
        model(torch.cat([example, example]))
    elif isinstance(example, list | tuple):
        model(*example)
    elif isinstance(example, dict):
        model(**example)


@contextmanager
def trial_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in training mode, then as it was: each module's mode and every buffer (the
    running statistics a training forward updates)."""
    modes = {module: module.training for module in model.modules()}
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.train()
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        for module, training in modes.items():
            module.training = training


@contextmanager
def running_modules(model: nn.Module) -> Iterator[list[nn.Module]]:
    """The modules of ``model`` running now, outermost first, kept by global forward hooks."""
    inside = {id(module) for module in model.modules()}
    running: list[nn.Module] = []

    def enter(module: nn.Module, args: Any) -> None:
        if id(module) in inside:
            running.append(module)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if running and running[-1] is module:
            running.pop()

    hooks = [
        nn.modules.module.register_module_forward_pre_hook(enter),
        nn.modules.module.register_module_forward_hook(leave),
    ]
    try:
        yield running
    finally:
        for hook in hooks:
            hook.remove()
