"""Networks, chosen by ``model.net.name``: the module of that name in this package.

A network is a plain ``nn.Module`` class named ``Net`` (an alias is fine) in its own module here,
whose ``__init__`` takes ``in_channels``, ``image_size`` ``(H, W)`` and ``num_classes`` (set from
the data) plus its own keys (set in ``conf/model/<name>.yaml`` under ``net:``). Adding one is a
new module and a config file; nothing else changes. Checkpoints record the name, so eval and
predict rebuild the same network.
"""

import importlib
from collections.abc import Mapping
from typing import Any

from torch import nn

SET_BY_DATA = ("in_channels", "image_size", "num_classes")
DEFAULT = "convnet"  # what checkpoints written before ``name`` existed hold


class UnknownNetwork(ValueError):
    """``model.net.name`` names no module here."""


def net_class(name: str) -> type[nn.Module]:
    """The ``Net`` of ``src/task/nets/<name>.py``."""
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise  # the module exists but imports something missing
        raise UnknownNetwork(
            f"model.net.name={name} names no network: add src/task/nets/{name}.py defining Net"
        ) from error
    return module.Net


def build(net: Mapping[str, Any], in_channels: int, image_size: tuple[int, int], num_classes: int):
    """The network ``net`` (its ``name`` and own keys) for images of this shape and classes."""
    keys = {key: value for key, value in net.items() if key != "name"}
    cls = net_class(net.get("name", DEFAULT))
    return cls(in_channels=in_channels, image_size=image_size, num_classes=num_classes, **keys)
