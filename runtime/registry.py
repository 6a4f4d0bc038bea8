"""What a run lets a socket name: registered "module:qualname" callables and writable path roots.

An endpoint that takes a reference to code (`RewardActor.rule("pkg.mod:fn", ...)`) or a path
(`TrainerActor.save_hf(path)`) must not let whoever reaches its socket run `os:system` or write
over `~/.ssh`. The driver registers what its run may name before it spawns actors:

    >>> from earl.runtime import registry
    >>> registry.register("earl.envs.arithmetic:score")  # or the function itself
    ['earl.envs.arithmetic:score']
    >>> registry.allow_root("runs/latest")  # doctest: +SKIP

`Runtime.spawn` hands the spawner's registrations to every actor it starts (they travel in the
`ActorSpec`, and through `$EARL_REGISTERED_REFS` / `$EARL_ALLOWED_ROOTS` to other child
processes such as tool workers). In the actor, `resolve(ref)` returns only a registered callable
and `check_path(path)` only a path under an allowed root. Modules that hand out process, file
or import powers (`os`, `subprocess`, `builtins`, `importlib`, `pickle`, ...) can never be
registered, and a resolved object must be defined in the module its reference names (so
`pkg.mod:os.system` does not reach `os`). Without explicit roots, the allowed roots are the
driver's working directory and the system temp directory.

This module imports nothing it resolves until a reference passes these checks; it does not
sandbox the code it returns (see `earl.runtime.sandbox` for untrusted code).
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["allow_root", "allowed_roots", "check_path", "install", "ref_of", "register",
           "registered", "resolve"]

ENV_REFS, ENV_ROOTS = "EARL_REGISTERED_REFS", "EARL_ALLOWED_ROOTS"
_REF = re.compile(r"^(__main__|[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*):[A-Za-z][A-Za-z0-9_]*"
                  r"(\.[A-Za-z][A-Za-z0-9_]*)*$")  # no private or dunder parts
_DENIED = frozenset((
    "builtins", "os", "posix", "nt", "posixpath", "sys", "subprocess", "shutil", "importlib",
    "runpy", "pickle", "marshal", "shelve", "ctypes", "socket", "pty", "code", "codeop",
    "multiprocessing", "signal", "io", "pathlib", "tempfile", "threading", "asyncio", "operator",
    "functools", "types", "gc", "inspect", "pdb", "webbrowser", "platform", "sysconfig",
    "site", "zipimport", "pkgutil", "torch", "numpy", "dill", "cloudpickle", "joblib"))
_refs: dict[str, Callable[..., Any] | None] = {}  # ref -> resolved object (None: not yet)
_roots: list[str] = []


def ref_of(fn: Callable[..., Any]) -> str:
    """The "module:qualname" reference of a module-level function or class."""
    module = "__main__" if fn.__module__ == "__mp_main__" else fn.__module__
    return f"{module}:{fn.__qualname__}"


def _check_ref(ref: object) -> str:
    if not isinstance(ref, str) or not _REF.match(ref):
        raise ValueError(f"reference {ref!r} must look like 'package.module:function' (public "
                         "names only, no '<locals>')")
    module = ref.partition(":")[0]
    if module.split(".")[0] in _DENIED:
        raise PermissionError(f"reference {ref!r} names module {module!r}, which gives process,"
                              " file or import powers; such references are never allowed")
    return ref


def register(*items: Callable[..., Any] | str) -> list[str]:
    """Allow references to these callables (functions, or "module:qualname" strings).

    Returns:
        The references registered, in order.

    Raises:
        ValueError: a string is not of the form "package.module:function".
        PermissionError: it names a denied module (os, subprocess, builtins, ...).
    """
    out = []
    for item in items:
        ref = _check_ref(item if isinstance(item, str) else ref_of(item))
        if ref not in _refs:
            _refs[ref] = None if isinstance(item, str) else item
        out.append(ref)
    os.environ[ENV_REFS] = ",".join(_refs)  # inherited by child processes (tool workers)
    return out


def registered() -> list[str]:
    """Every registered reference (what `Runtime.spawn` hands to actors)."""
    return list(_refs)


def resolve(ref: str, *, what: str = "reference",
            require_registration: bool = True) -> Callable[..., Any]:
    """The registered callable `ref` names.

    Args:
        ref: "package.module:function".
        what: how errors name it (e.g. "reward rule").
        require_registration: False only where `ref` comes from a trusted parent over a private
            pipe (the tool worker): then the other checks (no denied module, public names,
            defined where it says) still apply.

    Raises:
        PermissionError: `ref` is not registered in this run (or names a denied module).
        ValueError: malformed, not importable, or not defined where it says.
    """
    ref = _check_ref(ref)
    if ref not in _refs and require_registration:
        raise PermissionError(f"{what} {ref!r} is not registered in this run: call "
                              f"earl.runtime.registry.register({ref!r}) in the driver before "
                              "spawning the actors that use it")
    fn = _refs.get(ref)
    if fn is None:
        module, _, qual = ref.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in qual.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"{what} {ref!r} not found: {exc}") from None
        defined_in = getattr(obj, "__module__", None)
        if defined_in == "__mp_main__":  # the driver's script, as an actor process loads it
            defined_in = "__main__"
        if not callable(obj) or defined_in != module or getattr(obj, "__qualname__", None) != qual:
            raise ValueError(f"{what} {ref!r} is not a callable defined in {module}")
        if ref in _refs:
            _refs[ref] = obj
        fn = obj
    return fn


def allow_root(*paths: str | os.PathLike[str]) -> list[str]:
    """Allow path endpoints (checkpoints, exports) to use these directories and below.

    The first call replaces the default roots (working directory and temp directory).
    """
    for p in paths:
        real = os.path.realpath(os.fspath(p))
        if real == os.sep:
            raise PermissionError("allow_root('/') would let any path through: name the run's "
                                  "output directory instead")
        if real not in _roots:
            _roots.append(real)
    os.environ[ENV_ROOTS] = os.pathsep.join(_roots)
    return list(_roots)


def allowed_roots() -> list[str]:
    """The roots paths must lie under: the registered ones, else cwd and the temp directory."""
    if _roots:
        return list(_roots)
    cwd = os.path.realpath(os.getcwd())
    return [r for r in (cwd, os.path.realpath(tempfile.gettempdir())) if r != os.sep]


def check_path(path: str | os.PathLike[str], *, what: str = "path") -> str:
    """`path`, if it lies (symlinks resolved) under an allowed root.

    Raises:
        PermissionError: it does not; the message names the roots and how to add one.
    """
    real = os.path.realpath(os.fspath(path))
    roots = allowed_roots()
    if any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
        return os.fspath(path)
    raise PermissionError(f"{what} {os.fspath(path)!r} is outside the run's allowed roots "
                          f"{roots}: write under the run's output directory, or call "
                          "earl.runtime.registry.allow_root(DIR) in the driver before spawning "
                          f"(or set ${ENV_ROOTS}=DIR)")


def install(refs: Iterable[str], roots: Iterable[str]) -> None:
    """Adopt a spawner's registrations (the actor host calls this before building the actor)."""
    refs = [r for r in refs if r]
    if refs:
        register(*refs)
    roots = [r for r in roots if r]
    if roots:
        allow_root(*roots)


install(os.environ.get(ENV_REFS, "").split(","), os.environ.get(ENV_ROOTS, "").split(os.pathsep))
