"""The ConvNet is a plain module whose shape comes from config values."""

import torch
from torch import nn

from src.net import ConvNet


def test_logits_shape_and_gradients() -> None:
    net = ConvNet(num_classes=10)
    logits = net(torch.randn(5, 1, 28, 28))
    assert logits.shape == (5, 10)
    logits.sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_config_values_shape_the_network() -> None:
    net = ConvNet(channels=(4, 8, 16), hidden=12, dropout=0.0, batch_norm=False)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [4, 8, 16]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    assert net(torch.randn(2, 1, 28, 28)).shape == (2, 10)  # 28 → 14 → 7 → 3 after pooling


def test_batch_norm_is_on_by_default() -> None:
    assert sum(isinstance(m, nn.BatchNorm2d) for m in ConvNet().modules()) == 2
