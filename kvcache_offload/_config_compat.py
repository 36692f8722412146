"""The 0.1 names of settings that moved into ``transfer`` or were removed, for one release.

A moved setting given by its old name (a keyword argument, a config-file key, or its old
``KVCACHE_OFFLOAD_<NAME>`` environment variable) still takes effect, with a
``DeprecationWarning`` that names the new spelling; a removed one is ignored with a warning.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from kvcache_offload.tuning import MOVED_TO_TRANSFER, REMOVED_FIELDS

__all__ = ["OldEnvironmentNames", "move_old_names"]

_PREFIX = "KVCACHE_OFFLOAD_"


def _warn(message: str) -> None:
    warnings.warn(message, DeprecationWarning, stacklevel=4)


def move_old_names(values: Any) -> Any:
    """Move 0.1 top-level keys of ``values`` into its ``transfer`` mapping (with a warning);
    drop removed ones (with a warning). An old name wins over the same knob in ``transfer``,
    as the more specific of the two is the one the caller just wrote."""
    if not isinstance(values, dict):
        return values
    old = [k for k in values if k in MOVED_TO_TRANSFER or k in REMOVED_FIELDS]
    if not old:
        return values
    values = dict(values)
    transfer = values.get("transfer")
    moved: dict[str, Any] = {}
    if transfer is not None and not isinstance(transfer, dict):
        moved = transfer.model_dump(exclude_unset=True)  # a TransferTuning instance
    elif isinstance(transfer, dict):
        moved = dict(transfer)
    for key in old:
        value = values.pop(key)
        if key in REMOVED_FIELDS:
            _warn(f"setting {key!r} was removed and is ignored: {REMOVED_FIELDS[key]}")
            continue
        new = MOVED_TO_TRANSFER[key]
        _warn(
            f"setting {key!r} moved to 'transfer.{new}' "
            f"(environment: {_PREFIX}TRANSFER__{new.upper()}); the old name goes in 0.3"
        )
        moved[new] = value
    values["transfer"] = moved
    return values


class OldEnvironmentNames(PydanticBaseSettingsSource):
    """Reads the 0.1 environment variables of moved settings, below the current ones."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads everything at once

    def __call__(self) -> dict[str, Any]:
        environ = {k.upper(): v for k, v in os.environ.items() if k.upper().startswith(_PREFIX)}
        transfer: dict[str, Any] = {}
        for old, new in MOVED_TO_TRANSFER.items():
            name = _PREFIX + old.upper()
            if name in environ:
                _warn(
                    f"environment variable {name} is deprecated: use "
                    f"{_PREFIX}TRANSFER__{new.upper()}; the old name goes in 0.3"
                )
                transfer[new] = environ[name]
        for old, why in REMOVED_FIELDS.items():
            name = _PREFIX + old.upper()
            if name in environ:
                _warn(f"environment variable {name} is ignored: {why}")
        return {"transfer": transfer} if transfer else {}
