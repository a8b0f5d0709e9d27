"""Declared hooks: the base classes of the runtime's strategies (schedulers, revision
policies, placement policies, executors, commit rules) list every hook they call, with a
no-op default, and check a subclass when it is defined (NumPy only).

The loop calls hooks directly; nothing is looked up by name at run time. So that a misspelt
hook cannot fail silently, `HookBase.__init_subclass__` refuses, when the class statement
runs (before anything is constructed):

- a public method whose name is a near miss of a declared hook (`setle` for `settle`);
- an override of a hook that renames or drops one of its required parameters (callers pass
  them by keyword), or adds a required one.
"""

from __future__ import annotations

import difflib
import inspect
from typing import ClassVar


class HookError(TypeError):
    """A strategy class that misdeclares a hook."""


def _params(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


class HookBase:
    """A base class whose `HOOKS` are checked in every subclass."""

    HOOKS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        hooks = {name: owner for owner in reversed(cls.__mro__) if issubclass(owner, HookBase)
                 for name in owner.__dict__.get("HOOKS", ())}
        for name, value in cls.__dict__.items():
            if name.startswith("_") or not callable(value) or name in hooks:
                continue
            if any(name in vars(base) for base in cls.__mro__[1:]):
                continue  # overrides something that is not a hook
            near = difflib.get_close_matches(name, hooks, n=1, cutoff=0.8)
            if near:
                raise HookError(f"{cls.__qualname__}.{name} looks like a misspelling of the hook "
                                f"{near[0]!r} of {hooks[near[0]].__qualname__} (rename it, or prefix it "
                                f"with '_' if it is meant as a helper)")
        for name, owner in hooks.items():
            mine = cls.__dict__.get(name)
            if mine is None or owner is cls or not callable(mine) or not inspect.isfunction(mine):
                continue
            declared = _params(getattr(owner, name))
            given = {p.name: p for p in _params(mine)}
            if any(p.kind is p.VAR_KEYWORD for p in given.values()):
                continue
            # A declared parameter with a default may be left out (a caller passing it fails loudly).
            missing = [p.name for p in declared if p.kind is not p.VAR_KEYWORD and p.name not in given
                       and p.default is p.empty]
            extra = [p.name for p in given.values() if p.name not in {d.name for d in declared}
                     and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if missing or extra:
                raise HookError(f"{cls.__qualname__}.{name} does not match the hook declared by "
                                f"{owner.__qualname__}{inspect.signature(getattr(owner, name))}: "
                                + ", ".join(([f"missing {missing}"] if missing else [])
                                            + ([f"required extras {extra}"] if extra else [])))
