"""Every private API of a dependency the machinery uses, each because no public one does the job,
pinned by ``tests/test_private.py`` so that an upgrade changing one fails there, loudly.

* Lightning: ``_SubprocessScriptLauncher`` (re-runs the command for ranks 1..N-1) has no hook to
  watch what it starts: :class:`~src.template.distributed.WatchedLauncher` subclasses it (its
  ``launch``, ``_call_children_scripts()``, ``procs``), installed by
  ``DDPStrategy._configure_launcher()`` / ``._launcher``; ``_set_num_threads_if_needed``, each
  rank's CPU threads as Lightning's launch sets them.
* MLflow: ``SystemMetricsMonitor``'s samplers without its loop (``collect_metrics()``,
  ``aggregate_metrics()``, ``monitors``, ``clear_metrics()``), which stops at the first failed
  request.
* LitData, in the task's ``src/task/data/shards.py`` for ``s3://`` shards:
  ``downloader._OBSTORE_CLIENT_OPTIONS`` (to allow ``http://``) and
  ``StreamingDataset._create_cache(worker_env=_WorkerEnv.detect())`` with ``on_demand_bytes =
  False`` (whole shards into the bounded cache, not a ranged request per sample).
"""

from lightning.fabric.utilities.distributed import (
    _set_num_threads_if_needed as set_num_threads_if_needed,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

__all__ = ["SubprocessScriptLauncher", "set_num_threads_if_needed"]
