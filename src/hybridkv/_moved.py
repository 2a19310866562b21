"""Module paths of earlier releases, kept importable for code that embeds the library.

The modules moved into packages (``core``, ``planning``, ``scheduling``); ``import
hybridkv.scheduler`` still works and yields ``hybridkv.scheduling.scheduler`` itself (the same
module object, so ``isinstance`` checks and monkeypatching behave as before). New code should
import from ``hybridkv`` or the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

MOVED = {
    "hybridkv._util": "hybridkv.core._util",
    "hybridkv.specs": "hybridkv.core.specs",
    "hybridkv.layout": "hybridkv.core.layout",
    "hybridkv.hashing": "hybridkv.core.hashing",
    "hybridkv.sequence": "hybridkv.core.sequence",
    "hybridkv.block_pool": "hybridkv.core.block_pool",
    "hybridkv.coordinator": "hybridkv.core.hits",
    "hybridkv.managers": "hybridkv.core.kinds",
    "hybridkv.managers.base": "hybridkv.core.kinds.base",
    "hybridkv.managers.kinds": "hybridkv.core.kinds",
    "hybridkv.manager": "hybridkv.core.manager",
    "hybridkv.retention": "hybridkv.core.retention",
    "hybridkv.scheduler": "hybridkv.scheduling.scheduler",
    "hybridkv.planner": "hybridkv.planning.planner",
    "hybridkv.hardware": "hybridkv.planning.hardware",
    "hybridkv.models": "hybridkv.planning",
    "hybridkv.models.presets": "hybridkv.planning.presets",
    "hybridkv.models.hf_config": "hybridkv.planning.hf_config",
}
"""Old module path -> where it lives now."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path to the module at its new path."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is imported already."""


def install() -> None:
    """Make the old paths importable (idempotent)."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
