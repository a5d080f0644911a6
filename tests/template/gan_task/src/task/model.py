"""Lightning's "Basic GAN" tutorial, ported: a generator (``BatchNorm1d`` between its layers) and
a discriminator, trained by the model itself (``automatic_optimization = False``) with two Adam
optimizers, each step toggled (``toggle_optimizer``) and back-propagated with
``manual_backward``. Its losses are torchmetrics objects logged at epoch level, its noise drawn
for the global batch (exact on any number of ranks)."""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import MLFlowLogger
from lightning_exact import Batch, global_batch_randn, logged_step, sample_randn
from torch import Tensor, nn
from torchmetrics import Metric


class Generator(nn.Module):
    def __init__(self, latent_dim: int, hidden: Sequence[int], image_shape: Sequence[int]) -> None:
        super().__init__()
        self.image_shape = tuple(image_shape)

        def block(inputs: int, outputs: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(inputs, outputs)]
            if normalize:
                layers.append(nn.BatchNorm1d(outputs, 0.8))  # the tutorial's (0.8 is its eps)
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        widths = [latent_dim, *hidden]
        layers = [*block(widths[0], widths[1], normalize=False)]
        for inputs, outputs in zip(widths[1:], widths[2:], strict=False):
            layers += block(inputs, outputs)
        self.model = nn.Sequential(
            *layers, nn.Linear(widths[-1], math.prod(self.image_shape)), nn.Tanh()
        )

    def forward(self, z: Tensor) -> Tensor:
        return self.model(z).view(z.shape[0], *self.image_shape)


class Discriminator(nn.Module):
    def __init__(self, hidden: Sequence[int], image_shape: Sequence[int]) -> None:
        super().__init__()
        widths = [math.prod(image_shape), *hidden]
        layers: list[nn.Module] = []
        for inputs, outputs in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(inputs, outputs), nn.LeakyReLU(0.2, inplace=True)]
        self.model = nn.Sequential(*layers, nn.Linear(widths[-1], 1), nn.Sigmoid())

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images.flatten(1))


class SampleMean(Metric):
    """The mean of per-sample values from two sums: exact over any number of ranks."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("samples", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, values: Tensor) -> None:
        self.total.add_(values.sum())
        self.samples.add_(values.numel())

    def compute(self) -> Tensor:
        return self.total / self.samples


def stage_metrics() -> nn.ModuleDict:
    return nn.ModuleDict({"g_loss": SampleMean(), "d_loss": SampleMean()})


class GAN(L.LightningModule):
    SET_BY_DATA = ("image_shape",)

    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 28, 28),
        latent_dim: int = 16,
        g_hidden: tuple[int, ...] = (32, 64),
        d_hidden: tuple[int, ...] = (64, 32),
        lr: float = 0.0002,
        b1: float = 0.5,
        b2: float = 0.999,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.automatic_optimization = False  # the model steps its two optimizers itself
        self.generator = Generator(latent_dim, g_hidden, image_shape)
        self.discriminator = Discriminator(d_hidden, image_shape)
        self.example_input_array = torch.zeros(2, latent_dim)
        self.train_metrics, self.val_metrics, self.test_metrics = (
            stage_metrics() for _ in range(3)
        )

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    @property
    def weight(self) -> Tensor:
        """A weight of the generator: the dtype and device of noise drawn outside a step."""
        return self.generator.model[0].weight

    def losses(self, real: Tensor, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per sample: the generator's loss, the discriminator's on real and on fake images."""
        fake = self(z)
        ones = torch.ones(len(real), 1, dtype=real.dtype, device=real.device)
        g = F.binary_cross_entropy(self.discriminator(fake), ones, reduction="none")
        d_real = F.binary_cross_entropy(self.discriminator(real), ones, reduction="none")
        d_fake = F.binary_cross_entropy(
            self.discriminator(fake.detach()), torch.zeros_like(ones), reduction="none"
        )
        return g.flatten(), d_real.flatten(), d_fake.flatten()

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        real = batch.inputs  # normalised by the data's mean and std, as the tutorial's
        optimizer_g, optimizer_d = self.optimizers()
        # This rank's rows of the global batch's noise: on N ranks the numbers of one process.
        z = global_batch_randn(len(real), self.hparams.latent_dim, like=real)

        # The generator: fool the discriminator.
        self.toggle_optimizer(optimizer_g)
        ones = torch.ones(len(real), 1, dtype=real.dtype, device=real.device)
        g_losses = F.binary_cross_entropy(self.discriminator(self(z)), ones, reduction="none")
        self.manual_backward(g_losses.mean())
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        # The discriminator: tell real from generated.
        self.toggle_optimizer(optimizer_d)
        d_real = F.binary_cross_entropy(self.discriminator(real), ones, reduction="none")
        fake = self(z).detach()
        d_fake = F.binary_cross_entropy(
            self.discriminator(fake), torch.zeros_like(ones), reduction="none"
        )
        d_losses = (d_real + d_fake) / 2
        self.manual_backward(d_losses.mean())
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

        self.update_metrics("train", g_losses.detach(), d_losses.detach())

    def update_metrics(self, stage: str, g_losses: Tensor, d_losses: Tensor) -> None:
        metrics = getattr(self, f"{stage}_metrics")
        metrics["g_loss"].update(g_losses)
        metrics["d_loss"].update(d_losses)
        for name, metric in metrics.items():
            self.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=True)

    def evaluate(self, batch: Batch, stage: str) -> None:
        real = batch.inputs  # normalised by the data's mean and std, as the tutorial's
        # Noise fixed by each sample's index: every evaluation, and any number of ranks,
        # compares the same images.
        z = sample_randn(batch.indices, self.hparams.latent_dim, like=real)
        g, d_real, d_fake = self.losses(real, z)
        self.update_metrics(stage, g, (d_real + d_fake) / 2)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self.evaluate(batch, "test")

    def on_validation_epoch_end(self) -> None:
        """The tutorial's sample images, once a validation: 8 from fixed noise, logged to
        MLflow at this validation's step (through the job's outbox: an outage loses none)."""
        if self.trainer.sanity_checking or not isinstance(self.logger, MLFlowLogger):
            return
        z = sample_randn(torch.arange(8), self.hparams.latent_dim, like=self.weight)
        grid = image_grid(self(z))  # evaluation mode: the running BatchNorm statistics
        step = logged_step(self.trainer)
        self.logger.experiment.log_image(self.logger.run_id, grid, key="generated", step=step)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (self.hparams.b1, self.hparams.b2)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas),
        ]


def image_grid(images: Tensor, columns: int = 4) -> Any:
    """Images in [-1, 1] (``[N, C, H, W]``) as one ``uint8`` grid, ``[H, W]`` or ``[H, W, C]``
    (what ``MlflowClient.log_image`` takes)."""
    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    count, channels, height, width = pixels.shape
    rows = -(-count // columns)
    grid = torch.zeros(channels, rows * height, columns * width, dtype=torch.uint8)
    for i, image in enumerate(pixels):
        row, column = divmod(i, columns)
        grid[:, row * height : (row + 1) * height, column * width : (column + 1) * width] = image
    grid = grid.permute(1, 2, 0).numpy()
    return grid[..., 0] if channels == 1 else grid


def build(model: dict[str, Any], data: Any) -> GAN:
    return GAN(image_shape=data.image_shape, **model)


def config_targets(model: Mapping[str, Any]) -> dict[str, tuple[Any, tuple[str, ...]]]:
    return {"model": (GAN, GAN.SET_BY_DATA)}
