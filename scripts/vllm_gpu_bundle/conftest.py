"""The one fixture of vLLM's tests/conftest.py that test_gpu_worker.py uses, without the rest
of that conftest (it imports vLLM's whole engine, model helpers and media assets)."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest

# vLLM's structured-output backends name these packages in class annotations, evaluated when
# VllmConfig reaches the connector factory. The device image has none of them and the transfer
# tests never build a grammar: where one is missing, any of its names is an empty class.
_OPTIONAL = ("llguidance", "xgrammar", "outlines_core", "lmformatenforcer", "outlines")


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in _OPTIONAL:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (), {})
        return module

    def exec_module(self, module):
        pass


_missing = [n for n in _OPTIONAL if importlib.util.find_spec(n) is None]
if _missing:
    sys.meta_path.append(_Placeholders())


@pytest.fixture
def default_vllm_config():
    """A default VllmConfig as the current config, like vLLM's fixture of that name."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config
