"""Networks are plain modules built by name, shaped by the data and their config values."""

import pytest
import torch
from torch import nn

from src.task import nets
from src.task.nets.convnet import ConvNet


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


SHAPES = [(1, 28, 28), (3, 32, 32), (3, 24, 40)]


@pytest.mark.parametrize("name", ["convnet", "resnet"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_network_takes_any_channels_and_size(name: str, shape: tuple[int, int, int]) -> None:
    net = nets.build({"name": name}, in_channels=shape[0], image_size=shape[1:], num_classes=5)
    assert net(torch.randn(2, *shape)).shape == (2, 5)


def test_resnet_has_three_stages_of_basic_blocks_with_batch_norm() -> None:
    net = nets.build({"name": "resnet"}, in_channels=3, image_size=(32, 32), num_classes=5)
    blocks = [m for m in net.modules() if type(m).__name__ == "BasicBlock"]
    assert len(blocks) == 6 and any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    features = net.features(torch.randn(1, 3, 32, 32))
    assert features.shape == (1, 64, 8, 8)  # 32 → 16 → 8 over the two later stages


def test_an_unknown_network_names_the_module_to_add() -> None:
    with pytest.raises(nets.UnknownNetwork, match="add src/task/nets/no_such_net.py defining Net"):
        nets.net_class("no_such_net")  # not mlp: docs/make-it-yours.md adds that one
