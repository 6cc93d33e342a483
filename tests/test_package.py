"""Package-wide checks: every ``nn.Module`` subclass in freescale overrides only the
``nn.Module`` methods it means to, with nn.Module's own parameters. (A collection's
update method was once named ``_apply``, the hook behind ``.to()`` / ``.cpu()``, so
``model.to(device)`` raised a TypeError.)"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from torch import nn

import freescale

# the nn.Module methods freescale's modules override on purpose
OVERRIDES = {"__init__", "forward", "_apply"}


def _modules() -> list[type]:
    out = []
    for info in pkgutil.walk_packages(freescale.__path__, "freescale."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for cls in vars(mod).values():
            if (
                inspect.isclass(cls)
                and issubclass(cls, nn.Module)
                and cls.__module__ == mod.__name__
            ):
                out.append(cls)
    return out


def test_modules_override_only_what_they_mean_to() -> None:
    classes = _modules()
    assert any(c.__name__ == "ShardedEmbeddingCollection" for c in classes), classes
    for cls in classes:
        for name, value in vars(cls).items():
            if not callable(value) or not hasattr(nn.Module, name):
                continue
            where = f"{cls.__module__}.{cls.__qualname__}.{name}"
            assert name in OVERRIDES, f"{where} overrides nn.Module.{name}"
            if name in ("__init__", "forward"):
                continue
            ours = list(inspect.signature(value).parameters)
            theirs = list(inspect.signature(getattr(nn.Module, name)).parameters)
            assert ours == theirs, f"{where}{ours}: nn.Module calls it with {theirs}"
