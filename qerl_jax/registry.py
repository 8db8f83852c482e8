"""Named registries: the single source of every name a user picks (formats, losses, objectives,
advantage estimators, rewards, tasks, presets, kernel choices).

A registry maps a name to an implementation, or to the import path of one ("module:attr"), so
the built-in names are known without importing JAX: the config schema and `--help` read
`names()`, and `get(name)` imports the implementation the first time it is asked for. A name
registered from outside the package (a plug-in module named in `config.imports`) is selectable
like a built-in one.

    FORMATS = Registry("weight format")
    FORMATS.register_lazy("nvfp4", "qerl_jax.quant.nvfp4:NVFP4")
    @REWARDS.register("my_reward")
    def my_reward(completion, gold): ...
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable


class Registry:
    """Names -> implementations (or "module:attr" paths, resolved on first `get`)."""

    def __init__(self, kind: str):
        self.kind = kind                      # what the names are, for error messages
        self._entries: dict[str, Any] = {}    # name -> value, or _Lazy before first get
        self._aliases: dict[str, str] = {}    # alias -> registered name

    def register(self, name: str, value: Any = None, *, aliases: Iterable[str] = (),
                 replace: bool = False):
        """Registers `value` under `name`; without a value, a decorator that registers the
        decorated object and returns it unchanged."""
        if value is None:
            def decorator(obj):
                self.register(name, obj, aliases=aliases, replace=replace)
                return obj
            return decorator
        self._add(name, value, aliases, replace)
        return value

    def register_lazy(self, name: str, path: str, *, aliases: Iterable[str] = ()) -> None:
        """Registers the object at import path "module:attr" under `name` without importing it."""
        if ":" not in path:
            raise ValueError(f"{self.kind} {name!r}: lazy path must be 'module:attr', got {path!r}")
        self._add(name, _Lazy(path), aliases, replace=False)

    def _add(self, name: str, value: Any, aliases: Iterable[str], replace: bool) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        taken = name in self._entries or name in self._aliases
        if taken and not replace:
            # re-registering the same object (a module imported twice) is harmless
            if self._entries.get(name) is value:
                return
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = value
        for alias in aliases:
            if alias in self._entries or (alias in self._aliases and self._aliases[alias] != name):
                raise ValueError(f"{self.kind} alias {alias!r} is already taken")
            self._aliases[alias] = name

    def unregister(self, name: str) -> None:
        """Removes `name` and its aliases (tests and plug-ins that replace an entry)."""
        self._entries.pop(name, None)
        for alias in [a for a, target in self._aliases.items() if target == name]:
            del self._aliases[alias]

    def names(self, *, with_aliases: bool = False) -> tuple[str, ...]:
        """The registered names in registration order (then the aliases, if asked)."""
        names = tuple(self._entries)
        return names + tuple(self._aliases) if with_aliases else names

    def aliases(self) -> dict[str, str]:
        """alias -> registered name."""
        return dict(self._aliases)

    def canonical(self, name: str) -> str:
        """The registered name of `name` or of the entry it is an alias of."""
        name = self._aliases.get(name, name)
        if name not in self._entries:
            raise KeyError(self.unknown_message(name))
        return name

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def unknown_message(self, name: object) -> str:
        known = ", ".join(self.names(with_aliases=True))
        return f"unknown {self.kind} {name!r}; known: {known}"

    def get(self, name: str) -> Any:
        """The implementation registered under `name` (or an alias), imported if lazy."""
        name = self.canonical(name)
        value = self._entries[name]
        if isinstance(value, _Lazy):
            value = value.resolve(self.kind, name)
            self._entries[name] = value
        return value

    def items(self) -> list[tuple[str, Any]]:
        """(name, implementation) for every entry, importing the lazy ones."""
        return [(name, self.get(name)) for name in self.names()]


class _Lazy:
    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def resolve(self, kind: str, name: str) -> Any:
        module_name, attr = self.path.split(":", 1)
        module = importlib.import_module(module_name)
        try:
            return getattr(module, attr)
        except AttributeError:
            raise ImportError(f"{kind} {name!r}: {module_name} has no {attr!r}") from None


def import_plugins(modules: Iterable[str], on_error: Callable[[str, BaseException], None]):
    """Imports each plug-in module (its import registers its names); `on_error(module, exc)`
    turns a failed import into the caller's error."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported by the caller with the module's name
            on_error(module, exc)
