"""The registry: only registered refs resolve, never denied modules; paths stay under roots."""

from __future__ import annotations

import os

import pytest

from earl.runtime import registry


def test_only_registered_refs_resolve_and_denied_modules_never_do(monkeypatch):
    monkeypatch.setattr(registry, "_refs", {})
    monkeypatch.setenv(registry.ENV_REFS, "")  # restored after the test
    with pytest.raises(PermissionError, match="not registered in this run"):
        registry.resolve("earl.envs.arithmetic:score")
    assert registry.register("earl.envs.arithmetic:score") == ["earl.envs.arithmetic:score"]
    from earl.envs.arithmetic import score

    assert registry.resolve("earl.envs.arithmetic:score") is score
    assert "earl.envs.arithmetic:score" in os.environ[registry.ENV_REFS]  # for child processes
    for ref in ("os:system", "subprocess:run", "builtins:eval", "importlib:import_module",
                "pickle:loads", "os.path:join"):
        with pytest.raises(PermissionError, match="never allowed"):
            registry.register(ref)
        with pytest.raises(PermissionError, match="never allowed"):
            registry.resolve(ref, require_registration=False)
    for ref in ("earl.envs.arithmetic:_private", "x", "a:b:c", "earl.envs.arithmetic:<locals>"):
        with pytest.raises(ValueError, match="must look like"):
            registry.register(ref)
    # registered by mistake, a ref that walks into another module still does not resolve
    registry.register("earl.envs.arithmetic:re.compile")
    with pytest.raises(ValueError, match="not a callable defined in"):
        registry.resolve("earl.envs.arithmetic:re.compile")


def test_paths_must_stay_under_the_allowed_roots(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_roots", [])
    monkeypatch.setenv(registry.ENV_ROOTS, "")
    out = tmp_path / "run"
    out.mkdir()
    registry.allow_root(out)
    assert registry.check_path(out / "ckpt" / "step-1") == str(out / "ckpt" / "step-1")
    (out / "escape").symlink_to("/etc")
    for bad in ("/etc/passwd", str(out / ".." / "other"), str(out / "escape" / "x"),
                str(tmp_path)):
        with pytest.raises(PermissionError, match="outside the run's allowed roots"):
            registry.check_path(bad, what="save_hf path")
    with pytest.raises(PermissionError, match="any path"):
        registry.allow_root("/")
