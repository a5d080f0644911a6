"""The machinery's config groups, found by Hydra after the project's own ``conf/``: a project
holds its groups (data, model, experiment, searches) and overrides any of the library's with a
file of the same name (``conf/trainer/default.yaml``, even ``conf/train.yaml``)."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

SEARCH_PATH = "pkg://lightning_exact.conf"


class LightningExactConfig(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="lightning-exact", path=SEARCH_PATH)
