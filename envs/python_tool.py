"""The `python` tool: run a short program in the sandbox and return what it printed.

A module-level function so the tool executor's workers can import it. Isolation and limits are
`earl.runtime.sandbox`'s; this module only adapts it to a tool signature and a text result.
"""

from __future__ import annotations

__all__ = ["python"]


def python(code: str) -> str:
    """Run a Python program and return its printed output (stdout and stderr).

    Args:
        code: The program; print what you want to see.
    """
    from earl.runtime.sandbox import SandboxLimits, run_python  # lazy: keeps imports light

    limits = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mb=256, max_procs=16, output_chars=4096)
    result = run_python(code, limits)
    if not result.ok:
        raise RuntimeError(result.text())
    return result.output or "(no output)"
