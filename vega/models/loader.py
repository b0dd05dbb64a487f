"""Turn a model spec (``sensor``, ``torchscript:PATH``, ``aoti:PATH``, ``python:module:attr``)
into an adapter."""

from __future__ import annotations

import importlib
import inspect
import logging
import operator
import os
import re
import sys
from pathlib import Path
from typing import Any

from vega.models.base import ModelAdapter, SequenceModel

log = logging.getLogger("vega.models")


class ModelLoadError(Exception):
    """The model spec names something that cannot be loaded; the message says what."""


VERSION = re.compile(r"[A-Za-z0-9._-]{1,64}")


def default_name(spec: str) -> str:
    kind, _, rest = spec.partition(":")
    if kind in ("torchscript", "aoti"):
        return Path(rest).stem or "model"
    if kind == "python":
        return rest.rpartition(":")[2] or "model"
    return spec


def load_model(spec: str, name: str = "") -> ModelAdapter:
    """Build the adapter (weights on the CPU; ``load(device)`` moves them)."""
    name = name or default_name(spec)
    kind, _, rest = spec.partition(":")
    if spec == "sensor":
        from vega.models.sensor import sensor

        return sensor(name)
    if spec == "sensor-small":
        from vega.models.sensor import sensor_small

        return sensor_small(name)
    if kind == "torchscript":
        return _torchscript(rest, name)
    if kind == "python":
        return _python(rest, name)
    if kind == "aoti":
        return _compiled(rest, name)
    raise ModelLoadError(f"VEGA_MODEL={spec!r}: expected sensor, sensor-small, "
                         "torchscript:PATH, aoti:PATH or python:module:attr")


def _torchscript(path: str, name: str) -> ModelAdapter:
    import torch

    try:
        module = torch.jit.load(path, map_location="cpu")  # type: ignore[no-untyped-call]
    except Exception as exc:  # torch raises many types for a bad file
        raise ModelLoadError(f"torchscript:{path}: cannot load: {exc}") from None
    return _wrap_module(module, name)


def _compiled(path: str, name: str) -> ModelAdapter:
    from vega.models.compiled import CompiledModel, PackageError

    try:
        return CompiledModel(path, name)
    except PackageError as error:
        raise ModelLoadError(f"aoti:{error}") from None


def _python(target: str, name: str) -> ModelAdapter:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ModelLoadError(f"python:{target}: expected python:module:attr")
    # Found where it is installed, else in the working directory (as uvicorn finds an app);
    # last on the path, so a folder there cannot shadow an installed package.
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"python:{target}: {exc}") from None
    except Exception as exc:  # the user's module failed as it was imported
        raise _user_code_failed(target, "importing", exc) from None
    built = _built(found, target, name)
    if isinstance(built, ModelAdapter):
        built.name = name  # served as the README says: the attribute's, or VEGA_MODEL_NAME
        return built
    return _wrap_module(built, name)


def _built(found: Any, target: str, name: str) -> Any:
    """What ``python:module:attr`` names, built: a module or an adapter as it is; a
    function or class called with the model's name where a parameter is called ``name``,
    else with nothing where that binds, else with the name as the one argument it needs
    (a parameter with a default is the user's to set, not Vega's)."""
    import torch

    if isinstance(found, torch.nn.Module) or (
            not isinstance(found, type) and isinstance(found, ModelAdapter)):
        return found
    if not callable(found):
        raise ModelLoadError(f"python:{target}: found {type(found).__name__!r}, not a torch "
                             "module, an adapter, or a callable that builds one")
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # not known (a builtin): as documented, given the name
        call: tuple[tuple[str, ...], dict[str, str]] | None = ((name,), {})
    else:
        call = _arguments(signature, name)
    if call is None:
        raise ModelLoadError(f"python:{target}: {signature} takes neither the model's "
                             "name nor nothing")
    try:
        return found(*call[0], **call[1])
    except Exception as exc:
        raise _user_code_failed(target, "building the model", exc) from None


def _arguments(signature: inspect.Signature, name: str
               ) -> tuple[tuple[str, ...], dict[str, str]] | None:
    named = signature.parameters.get("name")
    tries: list[tuple[tuple[str, ...], dict[str, str]]] = [((), {}), ((name,), {})]
    if named is not None and named.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            inspect.Parameter.KEYWORD_ONLY):
        tries.insert(0, ((), {"name": name}))
    return next((t for t in tries if _binds(signature, *t)), None)


def _binds(signature: inspect.Signature, args: tuple[str, ...], kwargs: dict[str, str]
           ) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _user_code_failed(target: str, doing: str, error: Exception) -> ModelLoadError:
    """A one-line start failure (exit status 3) for an error in the user's own code, whose
    traceback goes to the log: that is where it is fixed."""
    log.error("python:%s: %s failed", target, doing, exc_info=error)
    return ModelLoadError(f"python:{target}: {doing} raised {type(error).__name__}: {error}")


def _wrap_module(module: Any, name: str) -> ModelAdapter:
    """A bare torch module: its ``vega_channels``/``vega_max_length``/``vega_min_length``/
    ``vega_version``/``vega_deterministic`` attributes, else 8/512/1/"1"/True; one that
    takes no ``lengths`` or holds other than float32 weights, fitted to them."""
    import torch

    if not isinstance(module, torch.nn.Module):  # a plain function has no .to, no weights
        got = "None (does the builder return it?)" if module is None \
            else type(module).__name__
        raise ModelLoadError(f"model {name!r} is neither an adapter nor a torch module: "
                             f"got {got}")
    from vega.models.fitted import fitted

    channels, max_length, min_length = (_count(module, attr, default, name) for attr, default
                                        in (("vega_channels", 8), ("vega_max_length", 512),
                                            ("vega_min_length", 1)))
    if not 1 <= min_length <= max_length:
        raise ModelLoadError(f"model {name!r}: vega_min_length {min_length} is not within "
                             f"1..vega_max_length ({max_length})")
    version = str(getattr(module, "vega_version", "1"))
    if not VERSION.fullmatch(version):  # one segment of /v2/models/{name}/versions/{version}
        raise ModelLoadError(f"model {name!r}: vega_version {version!r} is not 1-64 letters, "
                             "digits, '.', '_' or '-'")
    adapter = SequenceModel(fitted(module), name, channels=channels, max_length=max_length,
                            min_length=min_length, version=version)
    adapter.deterministic = bool(getattr(module, "vega_deterministic", True))  # for the cache
    return adapter


def _count(module: Any, attr: str, default: int, name: str) -> int:
    """A module's ``attr``: an int, 1 or more. A float is refused even when whole (64.0):
    int() would cut 99.7 to 99 silently, and one rule for every float is the plain one."""
    value = getattr(module, attr, default)
    try:
        if isinstance(value, bool):  # an int to Python, but True is no size
            raise TypeError
        number = operator.index(value)
    except TypeError:
        hint = f": write {int(value)}" if isinstance(value, float) and value.is_integer() \
            else ""
        raise ModelLoadError(f"model {name!r}: {attr} must be an int, 1 or more (not a "
                             f"float, even a whole one, nor a bool), not {value!r}{hint}"
                             ) from None
    if number < 1:
        raise ModelLoadError(f"model {name!r}: {attr} must be 1 or more, not {number}")
    return number
