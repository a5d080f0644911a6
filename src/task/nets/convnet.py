"""``model=convnet``: a small ConvNet, a plain ``nn.Module`` built from config values."""

from collections.abc import Sequence

import torch
from torch import nn


class ConvNet(nn.Module):
    """Conv blocks (conv 3x3 → [BatchNorm] → ReLU → 2x2 max-pool) and a two-layer classifier head.

    With the defaults (32, 64 channels) it reaches about 99% MNIST accuracy in two epochs at
    ~4 MFLOPs per image, several times cheaper than the 26x26 unpooled convs of the classic example.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: Sequence[int] = (28, 28),
        channels: Sequence[int] = (32, 64),
        hidden: int = 128,
        dropout: float = 0.25,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        height, width = image_size
        for channels_out in channels:
            blocks += [
                nn.Conv2d(in_channels, channels_out, 3, padding=1, bias=not batch_norm),
                nn.BatchNorm2d(channels_out) if batch_norm else nn.Identity(),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            in_channels = channels_out
            height = height // 2
            width = width // 2
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * height * width, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map a float batch [B, C, H, W] to class logits [B, num_classes]."""
        return self.classifier(self.features(images))


Net = ConvNet
