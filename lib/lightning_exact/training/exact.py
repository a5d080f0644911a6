"""Exact training at any world size: ``devices=N`` trains the weights ``devices=1`` trains.

Ranks already share the global batches
(:class:`~lightning_exact.checkpoints.resume.GlobalBatchSampler`) and DDP averages their gradients;
what still depended on the rank were the layers whose training forward looks at the batch a process
holds. :func:`make_exact` turns them, when the model is built and in place (as torch's
``convert_sync_batchnorm`` does, but keeping each layer's class as a base, its parameters, buffers
and state-dict keys), into global-batch layers:

* BatchNorm normalises with the statistics of the global batch, forward and backward, and its
  running statistics follow them: the same on every rank and as one process's. On GPUs torch's
  own SyncBatchNorm does it; elsewhere (CPU, gloo) one all-gather per layer of each rank's
  [mean, variance, count], whose backward (a reduce-scatter of their gradients) is autograd's.
* Dropout draws the mask of the whole global batch from the step's seed (the same on every rank:
  :class:`~lightning_exact.checkpoints.resume.SeedEachBatch`) and keeps this rank's rows, so a
  sample's mask depends on the seed, the step and its place in the global batch, never on the rank.

In evaluation mode, or in one process, each layer runs its torch class's own forward. While the
job trains, :class:`ExactTraining` (a callback) makes the dropout of
``F.scaled_dot_product_attention`` and ``F.dropout`` exact the same way
(:class:`ExactRandomFunctions`) and, on the first real training batch, names in one line what
is left to differ with the world size (:func:`inexact_layers`): a normalisation over the batch it
does not know, a random op that actually drew outside what is made exact.
"""

import inspect
import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_exact.private import (
    SyncBatchNormFunction,
    differentiable_all_gather,
    forward_redirected,
    op_arguments,
)

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


def inexact_kinds(model: nn.Module) -> dict[str, str]:
    """``path: why`` of each layer of ``model`` that, by its kind, trains differently on N ranks
    than on one: a normalisation with running statistics or a dropout left as it was (a
    subclass, a kind the template does not know)."""
    return {name: why for name, module in model.named_modules() if (why := why_inexact(module))}


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


def described(model: nn.Module, found: dict[str, str]) -> list[str]:
    """``path (Type: why)`` of each of ``found``'s layers."""
    return [
        f"{name or 'the model'} ({type(model.get_submodule(name)).__name__}: {why})"
        for name, why in found.items()
    ]


def inexact_layers(
    model: nn.Module, draws: dict[str, str] | None = None, step_draw: str | None = None
) -> list[str]:
    """``path (Type: why)`` of each layer of ``model`` that trains differently on N ranks than on
    one: by its kind, and each that drew random numbers outside what is made exact (``draws``,
    by :class:`ExactTraining` on the first real training batch: in a layer's forward, or
    ``step_draw`` in the training step itself, outside any forward)."""
    found = inexact_kinds(model)
    for name, op in (draws or {}).items():
        found.setdefault(name, why_drawn(model.get_submodule(name), op))
    step = [f"training_step ({type(model).__name__}: {why_drawn_in_step(step_draw)})"]
    return described(model, found) + (step if step_draw else [])


def why_drawn(module: nn.Module, op: str) -> str:
    """Why the random op ``op`` that ``module`` drew in a training forward is not exact."""
    if isinstance(module, nn.MultiheadAttention):  # its functional forward: out of reach
        return (
            "its dropout on the attention weights is drawn per rank; write the attention with "
            "F.scaled_dot_product_attention, whose dropout_p is made exact"
        )
    return f"draws random numbers in its forward: {op}"


def why_drawn_in_step(op: str) -> str:
    """Why the random op ``op`` drawn in a training step, outside any forward, is not exact."""
    return (
        f"draws random numbers per rank: {op}; draw a batch's noise with "
        "lightning_exact.global_batch_randn"
    )


# --- noise of a training step, exact -----------------------------------------------------

_drawing_exactly = 0  # inside global_batch_randn: its draws are exact (RandomOps stays quiet)


def global_batch_randn(
    rows: int,
    *size: int,
    like: Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Standard normal noise for this rank's ``rows`` samples (``[rows, *size]``), drawn for the
    whole global batch and cut to this rank's rows, as :func:`global_mask` draws dropout masks:
    on N ranks each sample gets the numbers one process gives it (the step's seed is the same on
    every rank: :class:`~lightning_exact.checkpoints.resume.SeedEachBatch`). For a training
    step's noise (a GAN's latent vectors), where ``torch.randn(rows, ...)`` would give every rank
    the first rows' numbers. ``like``: a tensor whose dtype and device the noise takes."""
    global _drawing_exactly
    rank, world = rank_and_world()
    dtype = dtype or (like.dtype if like is not None else None)
    device = device or (like.device if like is not None else None)
    _drawing_exactly += 1
    try:
        noise = torch.randn(rows * world, *size, dtype=dtype, device=device)
    finally:
        _drawing_exactly -= 1
    return noise[rank * rows : (rank + 1) * rows]


def sample_randn(
    indices: Tensor,
    *size: int,
    seed: int = 0,
    like: Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Standard normal noise of each sample (``[len(indices), *size]``), fixed by its stable
    ``index`` (``Batch.indices``) and ``seed``: the same numbers on any rank, in any batch, at
    every evaluation. For noise in validation, test and predict (whose batches are cut by
    samples, not as the global batch), drawn on the CPU in float64 from a generator of each
    sample's own, then converted."""
    dtype = dtype or (like.dtype if like is not None else torch.get_default_dtype())
    device = device or (like.device if like is not None else None)
    rows = [
        torch.randn(*size, generator=generator(seed, index), dtype=torch.float64)
        for index in indices.tolist()
    ]
    noise = torch.stack(rows) if rows else torch.empty(0, *size, dtype=torch.float64)
    return noise.to(dtype=dtype, device=device)


def generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator of its own for sample ``index``."""
    return torch.Generator().manual_seed((seed << 32) + index)


# --- attention dropout and functional dropout, exact ---------------------------------------


def exact_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` in training, its dropout drawn for the global batch
    (:func:`global_mask` on the attention weights, ``[batch, ..., L, S]``): torch's own math path
    (what it runs on the CPU with dropout), so one CPU process's draws and values are torch's."""
    length = query.shape[-2]
    source = key.shape[-2]
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa:  # grouped-query attention: each key and value head serves several queries
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, -3)
        value = value.repeat_interleave(repeats, -3)
    bias = query.new_zeros(length, source)
    if is_causal:
        visible = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        bias = bias.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(~attn_mask, float("-inf"))
        else:
            bias = bias + attn_mask
    scores = query @ key.transpose(-2, -1) * scale + bias
    # torch's _safe_softmax: a row that sees nothing attends to nothing (0, not NaN)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    keep = global_mask(weights, dropout_p, per_channel=False).div_(1 - dropout_p)
    return (weights * keep) @ value


def exact_dropout(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> Tensor:
    """``F.dropout``, its mask drawn for the global batch (as :class:`GlobalDropout`)."""
    keep = global_mask(input, p, per_channel=False).div_(1 - p)
    return input.mul_(keep) if inplace else input * keep


def call_arguments(like: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name, bound as ``like`` (a function of the same signature) takes
    them: torch's builtin SDPA has no Python signature, ours has its."""
    return inspect.signature(like).bind(*args, **kwargs).arguments


class ExactRandomFunctions(TorchFunctionMode):
    """Random functions called in a training forward, made exact at any world size: the dropout
    of ``F.scaled_dot_product_attention`` (``dropout_p``) and ``F.dropout``, their masks drawn
    for the global batch as :class:`GlobalDropout` draws its. In one CPU process torch's own
    functions run (they draw the same masks); on N ranks, or on an accelerator (whose fused
    attention kernels draw their masks their own way), the template's: attention as torch's math
    path, its weights materialised. ``calls_made_exact`` counts the template's own calls."""

    def __init__(self) -> None:
        super().__init__()
        self.exact_draws = 0
        self.calls_made_exact = 0  # on N ranks or an accelerator: the template's own
        self.inside = False  # in a call made exact: its draws are

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            arguments = call_arguments(exact_attention, args, kwargs)
            query = arguments["query"]
            if not arguments.get("dropout_p", 0.0) or query.dim() < 3:
                return func(*args, **kwargs)  # nothing drawn (or no batch to place a sample in)
            return self.made_exact(func, exact_attention, query, args, kwargs)
        if func is F.dropout:
            arguments = call_arguments(exact_dropout, args, kwargs)
            drawn = arguments.get("training", True) and 0 < arguments.get("p", 0.5) < 1
            if not drawn:
                return func(*args, **kwargs)
            return self.made_exact(func, exact_dropout, arguments["input"], args, kwargs)
        return func(*args, **kwargs)

    def made_exact(self, torchs: Any, ours: Any, input: Tensor, args: tuple, kwargs: dict) -> Any:
        _, world = rank_and_world()
        self.exact_draws += 1
        fused_attention = torchs is F.scaled_dot_product_attention and input.device.type != "cpu"
        own = world > 1 or fused_attention
        self.calls_made_exact += own
        self.inside = True
        try:
            return ours(*args, **kwargs) if own else torchs(*args, **kwargs)
        finally:
            self.inside = False


def draws_random_numbers(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether aten op ``func`` draws random numbers of torch's default generator (seeded per
    step alike on every rank) with these arguments: tagged so, not told to draw nothing (a
    ``dropout_p`` or dropout ``p`` of 0, ``train=False``: the CPU's fused attention op is tagged
    random whatever its ``dropout_p``), and not from a generator of the caller's own (seeded per
    sample, say: :func:`sample_randn`), whose numbers are the caller's to make the same."""
    if RANDOM not in func.tags:
        return False
    given = op_arguments(func, args, kwargs)
    if given.get("train") is False or given.get("dropout_p") == 0:
        return False
    if given.get("generator") is not None:
        return False
    return not ("dropout" in func.__name__ and given.get("p") == 0)


RANDOM = torch.Tag.nondeterministic_seeded  # the tag of every aten op that may draw numbers


class RandomOps(TorchDispatchMode):
    """Notes each aten op that draws random numbers, by the innermost module running it (the
    model itself: in its ``forward``) or in the training step outside any forward, but for the
    draws made exact (a global-batch dropout's, those of ``exact``'s functions and of
    :func:`global_batch_randn`)."""

    def __init__(self, running: list[nn.Module], exact: ExactRandomFunctions) -> None:
        super().__init__()
        self.running = running
        self.exact = exact
        self.found: dict[nn.Module, str] = {}
        self.in_step: str | None = None  # the first op drawn outside any forward

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        innermost = self.running[-1] if self.running else None
        exact = self.exact.inside or _drawing_exactly or isinstance(innermost, GlobalDropoutNd)
        if innermost is not None and not exact and draws_random_numbers(func, args, kwargs):
            if len(self.running) == 1:  # the model at the bottom: its training step
                self.in_step = self.in_step or str(func.overloadpacket)
            else:
                self.found.setdefault(innermost, str(func.overloadpacket))
        return func(*args, **kwargs)


@contextmanager
def running_modules(model: nn.Module) -> Iterator[list[nn.Module]]:
    """The modules of ``model`` running now, outermost first (``model`` itself at the bottom:
    a training step runs in it), kept by global forward hooks. A call of ``model`` whose
    ``forward`` is replaced on the instance is not its forward: Lightning calls the training step
    so through a DDP wrapper (:func:`~lightning_exact.private.forward_redirected`)."""
    inside = {id(module) for module in model.modules()}
    running: list[nn.Module] = [model]

    def enter(module: nn.Module, args: Any) -> None:
        redirected = module is model and forward_redirected(module)
        if id(module) in inside and not redirected:
            running.append(module)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if len(running) > 1 and running[-1] is module:
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


class ExactTraining(Callback):
    """``strategy.exact`` while training: the random functions of each training step made exact
    (:class:`ExactRandomFunctions`, kept on after the first step only where it found any to make
    exact) and, on the job's first real training batch, what is left to differ with the world
    size named in one line by rank 0 (:func:`inexact_layers`): the model's layers by their kind,
    and every random aten op the step actually drew outside what is made exact (no example input
    needed, none drawn at dropout 0 or in evaluation)."""

    def __init__(self) -> None:
        self.functions = ExactRandomFunctions()
        self.checked = False  # the first batch ran and what it found was named
        self.scope: ExitStack | None = None
        self.ops: RandomOps | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.checked and not self.functions.calls_made_exact:
            return  # nothing of the template's to run: torch's own functions, no mode
        self.scope = ExitStack()
        if not self.checked:  # the first step runs eagerly (compiled, ops are not seen) ...
            self.scope.enter_context(torch.compiler.set_stance("force_eager"))
            running = self.scope.enter_context(running_modules(pl_module))
        self.scope.enter_context(self.functions)
        if not self.checked:  # ... and under the op check
            self.ops = self.scope.enter_context(RandomOps(running, self.functions))

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor
    ) -> None:
        if pl_module.automatic_optimization:  # the forward is done (manual: the step isn't)
            self.end_step(pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.end_step(pl_module)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self.scope is not None:
            self.scope.close()
            self.scope = None

    def end_step(self, pl_module: L.LightningModule) -> None:
        if self.scope is None:
            return
        self.scope.close()
        self.scope = None
        if not self.checked:
            self.checked = True
            names = {module: name for name, module in pl_module.named_modules()}
            draws = {names[module]: op for module, op in self.ops.found.items()}
            name_inexact_layers(pl_module, draws, self.ops.in_step)
            self.ops = None


@rank_zero_only
def name_inexact_layers(
    model: nn.Module, draws: dict[str, str] | None = None, step_draw: str | None = None
) -> None:
    """One warning naming each layer of ``model`` left to differ with the world size
    (:func:`inexact_layers`), by rank 0."""
    if layers := inexact_layers(model, draws, step_draw):
        rank_zero_warn(
            "strategy.exact: what trains differently on N ranks than on one: "
            f"{'; '.join(layers)} (docs/make-it-yours.md, step 2)"
        )
