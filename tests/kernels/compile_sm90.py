"""Compiling kernels for sm90 on a machine without a GPU (Triton's compiler needs none), in a subprocess without
TRITON_INTERPRET: the tests that check what the compiled kernels do (fp32 math of fp64 scalars, the layouts and
barriers of kernels that write over what they read) and that every launch the suite makes compiles.

``run_script`` runs the subprocess; ``frontend_ir`` and ``compile_launch`` are for the scripts it runs (which
import this module: they see no TRITON_INTERPRET, so ``triton.jit`` gives real JIT functions there)."""
import inspect
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


SM90 = ("cuda", 90, 32)


def frontend_ir(fn, signature: dict, constexprs: dict, attrs: dict | None = None, options: dict | None = None) -> str:
    """The kernel's Triton IR as its frontend writes it (where types are checked: a variable's type across the
    branches of an ``if``, a loop-carried type), before any pass; the full compile's TTIR where this Triton's
    internals differ."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget(*SM90)
    try:
        backend = make_backend(target)
        parsed = backend.parse_options(options or {})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        available = dict(target=target, options=parsed, codegen_fns=backend.get_codegen_implementation(parsed),
                         module_map=backend.get_module_map(), context=context)
        parameters = inspect.signature(source.make_ir).parameters
        make_ir = lambda: source.make_ir(**{name: available[name] for name in parameters})  # noqa: E731
    except (AttributeError, KeyError, TypeError):
        return triton.compile(source, target=target, options=options).asm["ttir"]
    return str(make_ir())


def compile_launch(launch: dict, full: bool) -> str | None:
    """Compile one launch recorded by ``launches.py`` for sm90: its frontend, or (``full``) down to the cubin
    (ptxas included). None if it compiles, else the error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        if "unrecorded" in launch:
            raise TypeError(f"the launch could not be recorded: {launch['unrecorded']}")
        fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        index = {name: i for i, name in enumerate(fn.arg_names)}
        for name, value in launch["constexprs"].items():
            if isinstance(value, dict):
                raise TypeError(f"{name}: {value['unrecorded']} (not recorded)")
        constexprs = {(index[name],): value for name, value in launch["constexprs"].items()}
        attrs = {(index[name],): [["tt.divisibility", 16]] for name in launch["divisible"]}
        if full:
            source = ASTSource(fn=fn, signature=launch["signature"], constexprs=constexprs, attrs=attrs)
            triton.compile(source, target=GPUTarget(*SM90), options=launch["options"])
        else:
            frontend_ir(fn, launch["signature"], constexprs, attrs, launch["options"])
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"[-2000:]
    return None
