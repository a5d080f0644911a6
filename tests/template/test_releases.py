"""One version, said alike everywhere: the library's (lib/pyproject.toml), the template's pin of
it, what ``lightning_exact.__version__`` says, and the CHANGELOG's entry for it, which tells a
project what it must change and what it may drop."""

import tomllib

import lightning_exact

from tests.conftest import PROJECT
from tests.template.releases import version_at


def test_the_library_the_template_and_the_package_say_one_version() -> None:
    version = version_at(PROJECT, "")
    project = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]
    assert f"lightning-exact=={version}" in project["dependencies"]
    assert project["version"] == version
    assert lightning_exact.__version__ == version


def test_the_changelog_says_what_this_release_asks_of_a_project() -> None:
    version = version_at(PROJECT, "")
    changelog = (PROJECT / "CHANGELOG.md").read_text()
    heading = f"## {version} — "
    assert heading in changelog, f"CHANGELOG.md has no entry for {version}"
    entry = changelog.split(heading, 1)[1].split("\n## ", 1)[0]
    assert "**Must change**" in entry and "**May drop:**" in entry
