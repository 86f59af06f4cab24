"""Compiling kernels for sm90 on a machine without a GPU (Triton's compiler needs none), in a subprocess without
TRITON_INTERPRET, to read their IR: the tests that check what the compiled kernels do (fp32 math of fp64 scalars,
the layouts and barriers of kernels that write over what they read)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def why_not_here() -> str | None:
    """Why this Triton cannot compile the kernels for sm90 the way the scripts do, or None."""
    try:
        import inspect

        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource
    except ImportError as error:
        return f"this Triton lacks {error.name}"
    if "constexprs" not in inspect.signature(ASTSource).parameters:  # (and its attrs as a dict)
        return "this Triton's ASTSource predates the constexprs= signature (triton < 3.3)"
    return None


def run_script(script: str, *args: str) -> list:
    """Run ``script`` (which prints one line ``RESULTS <json>``) and return that JSON; skip where it cannot run."""
    reason = why_not_here()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULTS ")]
    if run.returncode != 0 or not lines:
        pytest.fail(f"the compile script failed:\n{run.stderr[-4000:]}")
    return json.loads(lines[0][len("RESULTS "):])
