"""Everything that talks to MLflow, one job per module: the store (``store``), a job's run set up
(``run``) and its logger (``logger``), what it records at the end (``outcome``) and the MLflow
model (``mlflow_model``), the durable queue of records to a server (``outbox``), system metrics
(``system_metrics``) and a sweep's parent run and summary (``sweep_run``). A job with
``logger=csv`` or ``logger=none`` never imports ``mlflow``: these modules import it where they
use it."""
