"""Registry: names to objects, lazy "module:attr" imports, unknown names list the known ones."""

from __future__ import annotations

import sys

import pytest

from engine.registry import Registry


def test_get_returns_the_registered_object():
    registry: Registry[int] = Registry("widget")
    registry.register("one", 1)
    assert registry.get("one") == 1
    assert "one" in registry
    assert "two" not in registry


def test_unknown_name_raises_key_error_listing_known_names_sorted():
    registry: Registry[int] = Registry("attention backend")
    registry.register("torch", 1)
    registry.register("cupy", 2)
    with pytest.raises(KeyError) as info:
        registry.get("flash")
    assert info.value.args[0] == "unknown attention backend 'flash'; known: cupy, torch"


def test_unknown_name_in_an_empty_registry_says_none_are_known():
    with pytest.raises(KeyError) as info:
        Registry("scaler").get("k8s")
    assert info.value.args[0] == "unknown scaler 'k8s'; known: none"


def test_registering_a_name_twice_raises():
    registry: Registry[int] = Registry("policy")
    registry.register("round_robin", 1)
    with pytest.raises(ValueError, match="policy 'round_robin' is already registered"):
        registry.register("round_robin", 2)
    assert registry.get("round_robin") == 1


def test_names_are_sorted():
    registry: Registry[int] = Registry("thing")
    for name in ("b", "c", "a"):
        registry.register(name, 0)
    assert registry.names() == ["a", "b", "c"]


def test_lazy_entry_imports_its_module_on_first_get_only(tmp_path, monkeypatch):
    module = "pdserve_registry_lazy_probe"
    (tmp_path / f"{module}.py").write_text("LOADS = []\nLOADS.append(1)\nclass Backend:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    registry: Registry[type] = Registry("backend")
    registry.register("probe", f"{module}:Backend")
    assert module not in sys.modules
    backend = registry.get("probe")
    assert backend.__name__ == "Backend"
    assert backend.__module__ == module
    assert registry.get("probe") is backend
    assert sys.modules[module].LOADS == [1]
    monkeypatch.delitem(sys.modules, module)


def test_lazy_entry_with_a_missing_module_fails_at_get_not_at_register():
    registry: Registry[type] = Registry("backend")
    registry.register("missing", "pdserve_no_such_module_xyz:Thing")
    with pytest.raises(ModuleNotFoundError):
        registry.get("missing")


def test_model_family_llama_is_registered_lazily():
    from engine.model import MODEL_FAMILIES

    assert MODEL_FAMILIES.names() == ["llama"]
    with pytest.raises(KeyError, match="unknown model family 'mistral'; known: llama"):
        MODEL_FAMILIES.get("mistral")
