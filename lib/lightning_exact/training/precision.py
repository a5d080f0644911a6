"""``trainer.precision`` where the template or a task runs the model outside Lightning's loops
(the model summary's example forward, figures of the test split): the inputs converted and the
forward run as the loops convert and run them (``64-true``: float64 inputs; ``bf16-mixed``:
autocast), through the trainer's own precision plugin; precisions that cannot run here refused.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.plugins.precision import DoublePrecision, Precision

from lightning_exact.job.config import ConfigError

# Lightning's precisions this template does not train with, and why (one line at start). The
# rest (64-true, 32-true, bf16-mixed, bf16-true, 16-true; 16-mixed on GPUs) run everywhere the
# template runs the model.
REFUSED = {
    "transformer-engine": "NVIDIA Transformer Engine layers, which the template's tests never ran",
    "transformer-engine-float16": "NVIDIA Transformer Engine layers, which the template's tests "
    "never ran",
}


def check_precision(precision: Any, on_cpu: bool) -> None:
    """Refuse, in one line, a ``trainer.precision`` that would not train as typed: a Transformer
    Engine precision, or float16 autocast on the CPU (``on_cpu``: Lightning would switch to
    bfloat16 with a warning, a job that does not run what its config says)."""
    name = str(precision)
    if name in REFUSED:
        raise ConfigError(
            f"trainer.precision={name}: needs {REFUSED[name]}; use 64-true, 32-true, bf16-mixed, "
            "bf16-true or 16-true (16-mixed on GPUs)"
        )
    if name in ("16-mixed", "16") and on_cpu:
        raise ConfigError(
            f"trainer.precision={name}: float16 autocast runs on GPUs only; on the CPU use "
            "bf16-mixed (or accelerator=gpu)"
        )


def model_init_context(precision: Any) -> AbstractContextManager:
    """What Lightning's ``Trainer.init_module()`` gives a model built before its Trainer: under
    ``64-true`` float64 weights from the start. Lightning loads a resumed checkpoint's weights
    before its precision plugin converts the module, so a float32-built model would round every
    float64 weight to float32 once at each resume (measured: 6e-8 of a tensor's largest value)."""
    if str(precision) in ("64-true", "64"):
        return DoublePrecision().module_init_context()
    return nullcontext()


def precision_plugin(model: L.LightningModule) -> Precision:
    """The precision plugin of the Trainer ``model`` is attached to; Lightning's float32 one for
    a model without a Trainer (one rebuilt from a checkpoint)."""
    try:
        return model.trainer.precision_plugin
    except RuntimeError:  # "not attached to a `Trainer`"
        return Precision()


@contextmanager
def trainer_precision(model: L.LightningModule) -> Iterator[Callable[[Any], Any]]:
    """Run ``model`` as the Trainer's loops run it: inside, the precision's forward context
    (``64-true``: float64 by default; mixed: autocast); yields the function that converts an
    input (a tensor or a collection of them) as the loops convert each batch."""
    plugin = precision_plugin(model)
    with plugin.forward_context():
        yield plugin.convert_input
