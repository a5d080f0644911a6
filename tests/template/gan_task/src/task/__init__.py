"""Lightning's "Basic GAN" tutorial on the image task's data modules: a task that steps its own
two optimizers (manual optimization), put in place of the image classifier by
``tests/template/test_gan_task.py`` in a copy of the project. ``src/task/data/`` and
``conf/data/`` are the image task's, kept; this folder's files are copied over the rest of
``src/task/`` and ``conf/`` as they are."""

from lightning_exact import Task

from . import generate, model
from .data import DATAMODULES

TASK = Task(
    datamodules=DATAMODULES,  # the image task's: the same images, another task
    model_class=model.GAN,
    build_model=model.build,
    config_targets=model.config_targets,
    monitor="val/g_loss",  # how well the generator fools the discriminator, on fixed noise
    mode="min",
    errors=(generate.BadCount,),
    predict_inputs=generate.generate_images,  # src.predict inputs=N: N new images
)
