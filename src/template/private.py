"""Every private API of a dependency the machinery relies on, in one place, each because no
public one does the job. ``tests/test_private.py`` pins each one: an upgrade that changes any
of them fails there, loudly, instead of the machinery silently falling back.

Lightning (pinned in pyproject.toml):

* ``_SubprocessScriptLauncher``: the launcher that re-runs the command for ranks 1..N-1. It has
  no hook to watch the processes it starts, so :class:`~src.template.distributed.WatchedLauncher`
  subclasses it, overriding ``launch`` and calling ``_call_children_scripts()`` and reading
  ``procs``; ``DDPStrategy._configure_launcher()`` / ``._launcher`` install it.
* ``_set_num_threads_if_needed``: the CPU thread count each rank gets, as Lightning's launch.

MLflow (pinned): ``SystemMetricsMonitor``'s samplers, used without its logging loop
(``collect_metrics()``, ``aggregate_metrics()``, ``monitors`` and their ``clear_metrics()``):
MLflow's loop writes to the store directly and stops at the first failed request.

LitData (pinned), in the task's ``src/task/data/shards.py`` for ``s3://`` shards: its obstore
client options (``downloader._OBSTORE_CLIENT_OPTIONS``, to allow an ``http://`` endpoint), and
``StreamingDataset._create_cache(worker_env=_WorkerEnv.detect())`` with ``on_demand_bytes =
False`` (whole shards into the bounded cache instead of one ranged request per sample).
"""

from lightning.fabric.utilities.distributed import (
    _set_num_threads_if_needed as set_num_threads_if_needed,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

__all__ = ["SubprocessScriptLauncher", "set_num_threads_if_needed"]
