"""``model=resnet``: a small ResNet for small images (He et al.'s CIFAR design): a 3x3 stem, then
stages of basic residual blocks, each later stage halving the resolution and widening, global
average pooling and a linear head. Any image size and channel count."""

from collections.abc import Sequence

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BatchNorm layers and a shortcut (1x1 conv where the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut = (
            nn.Identity()
            if stride == 1 and in_channels == out_channels
            else nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """``widths[i]`` channels and ``blocks_per_stage`` blocks in stage ``i``."""

    def __init__(
        self,
        in_channels: int,
        image_size: Sequence[int],
        num_classes: int,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int = 2,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        if not batch_norm:
            raise ValueError("model.net.batch_norm=false: this ResNet is built with BatchNorm")
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        ]
        channels = widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(channels, width, stride))
                channels = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map a float batch [B, C, H, W] to class logits [B, num_classes]."""
        return self.classifier(self.features(images))


Net = ResNet
