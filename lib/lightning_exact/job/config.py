"""What a user typed, checked before any work and refused in one line that names the fix:
Hydra's reports of the command line made one line, and what YAML cannot know (that
``+model.learning_rate=...`` fits what ``model`` is passed to) checked."""

import difflib
import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException, OverrideParseException
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from omegaconf import DictConfig, OmegaConf


def describe_config_error(error: Exception, set_by: Mapping[str, str] | None = None) -> str:
    """One line for Hydra's composition errors, listing the valid keys or options, or, for a
    key in ``set_by`` (``trainer.devices`` -> what sets it), where to set it instead."""
    if isinstance(error, MissingConfigException) and error.options is not None:
        group, _, option = (error.missing_cfg_file or "").rpartition("/")
        if group:
            return (
                f"{group}={option} is not an option of the '{group}' group; options: "
                f"{', '.join(sorted(error.options))} (files in conf/{group}/, the project's or "
                "the library's)"
            )
    if isinstance(error, OverrideParseException):
        reason = error.message.splitlines()[0]
        return (
            f"{error.override} is not a valid override ({reason}); the form is key=value, "
            "quoted for the shell where it holds brackets or spaces: 'key=[1,2]'"
        )
    if added := added_to_a_set_key(error):
        return added
    typed = re.match(r"Could not override '([^']+)'", str(error))
    parent = getattr(error.__cause__, "parent_node", None)
    if typed and isinstance(parent, DictConfig):
        key = typed.group(1)
        if set_by and key in set_by:
            return f"{key} is set from {set_by[key]}; remove {key}"
        # The first key of the path that is not there: mdoel in mdoel.lr, lrr in model.lrr.
        missing = getattr(error.__cause__, "full_key", None) or key
        section = missing.rpartition(".")[0]
        rest = key.removeprefix(missing)
        where = f"{section} has" if section else "top-level keys are"
        keys = ", ".join(sorted(str(k) for k in parent))
        near = suggest(missing, parent.keys(), section, rest)
        return f"{key} is not a config key{near}; {where}: {keys}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "... raised while composing config:" + why
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def added_to_a_set_key(error: Exception) -> str | None:
    """Hydra's ``+`` adds a key that is absent or null, and refuses one that has a value."""
    already = r"An item is already at '([^']+)'.*remove \+ prefix: '([^']+)'"
    if there := re.search(already, str(error), re.DOTALL):
        key, plain = there.groups()
        return (
            f"+{plain}: {key} already has a value; set it without +: {plain} "
            "(Hydra's + only adds a key that is absent or null)"
        )
    return None


def suggest(key: str, valid: Iterable[Any], section: str, rest: str = "") -> str:
    """`` (did you mean model.lr?)`` for a near miss of ``key``'s last name among ``valid``
    (``rest``: what the typed key has after it, ``.lr`` for ``mdoel.lr``), else nothing."""
    name = key.rpartition(".")[2]
    close = difflib.get_close_matches(name, [str(k) for k in valid], n=1)
    return f" (did you mean {section + '.' if section else ''}{close[0]}{rest}?)" if close else ""


def check_keys(
    section: str,
    values: Mapping[str, Any],
    target: Callable,
    set_by: Mapping[str, str] | None = None,
) -> None:
    """Refuse keys of config ``section`` that ``target`` does not take, or that are set elsewhere
    (``set_by``: key -> what sets it), naming the valid ones."""
    parameters = inspect.signature(target).parameters
    set_by = set_by or {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return  # takes anything
    valid = [key for key in parameters if key not in set_by]
    for key in values:
        if key == "name":  # which class: the selector, not a constructor argument
            continue
        if key in set_by:
            raise ConfigError(f"{section}.{key} is set from {set_by[key]}; remove {section}.{key}")
        if key not in parameters:
            raise ConfigError(
                f"{section}.{key} is not a setting of {section} "
                f"({getattr(target, '__name__', target)}){suggest(key, valid, section)}; "
                f"valid keys: {', '.join(f'{section}.{k}' for k in valid)}"
            )


def check_sections(cfg: DictConfig, targets: Mapping[str, tuple[Callable, Iterable[str]]]) -> None:
    """:func:`check_keys` for each section, its target and the keys set from the data."""
    for section, (target, set_by_data) in targets.items():
        values = OmegaConf.select(cfg, section) or {}
        check_keys(section, values, target, set_by=dict.fromkeys(set_by_data, "the data"))


@contextmanager
def as_config_error(section: str) -> Iterator[None]:
    """A constructor's error for a typed value (``model.net.dropout=1.5``) becomes one line."""
    try:
        yield
    except (TypeError, ValueError, ConfigError) as error:
        reason = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise ConfigError(f"{section} settings refused: {reason}") from error


def check_choice(key: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{key}={value} is not valid; use {key}=" + f" or {key}=".join(map(str, choices))
        )


def is_count(value: Any, minimum: int) -> bool:
    """Whether ``value`` is a whole number (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_count(key: str, value: Any, minimum: int) -> None:
    if not is_count(value, minimum):
        raise ConfigError(f"{key}={value} is not valid: it must be a whole number >= {minimum}")


def typed_keys(section: str) -> set[str]:
    """The keys of ``section`` the command line set (``data.root=...``), ``""`` for the section's
    group option itself (``data=NAME``)."""
    if not HydraConfig.initialized():
        return set()
    keys = [f"{o.split('=', 1)[0].lstrip('+~')}." for o in HydraConfig.get().overrides.task]
    prefix = f"{section}."
    return {key.removeprefix(prefix).split(".")[0] for key in keys if key.startswith(prefix)}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"lr": 0.1}}`` → ``{"model.lr": 0.1}``: the keys people type as overrides."""
    if not isinstance(tree, Mapping):
        return {prefix.rstrip("."): tree}
    return {
        k: v for key, value in tree.items() for k, v in flatten(value, f"{prefix}{key}.").items()
    }
