"""The team's tracking service (docs/tracking-server.md): ``python -m lightning_exact.server
start|status|stop|add-user|grant|backup|restore|upgrade`` runs ``tracking.sh`` beside this file,
which starts PostgreSQL, MLflow's basic-auth server and caddy's TLS under supervisord. Its files
ship with the library, so a team takes the service's fixes by installing the next version."""

from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "tracking.sh"
