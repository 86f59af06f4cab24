"""Every kernel launch of the CPU suite, recorded under the Triton interpreter as the specialization a GPU would
compile: Triton's own type of each argument (``*bf16``, ``i32``, ``i64``, ``fp32``, a tensor descriptor; an int
of 1 or a None as a constant), its 16-divisibility, the constexpr values and the launch options (num_warps,
num_stages). ``test_launches_compile.py`` compiles each one for sm90 afterwards, without a GPU.

Why: the interpreter runs a kernel as numpy and checks no types, so a kernel can pass the whole CPU suite and
fail to compile on the first GPU call (kernels/scale_grad.py did: a variable whose type differed between the
branches of an ``if``). The hand-written signatures of test_fp64_scalars.py / test_in_place.py cover the kernels
they read; these cover what the launchers really launch, with every option the suite sets.
"""
from __future__ import annotations

import inspect
import json

from .compile_sm90 import why_not_here

#: JSON of one launch's specialization (see ``_specialization``), in the order first seen.
LAUNCHES: dict[str, None] = {}
_SIGNATURES: dict = {}
_recording = False


def start_recording() -> bool:
    """Wrap the interpreter's launch to record each fused_lm_loss kernel launch; False where this Triton lacks
    what it takes (the compile test then skips, as compile_sm90.why_not_here says)."""
    global _recording
    if _recording:
        return True
    if why_not_here() is not None:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import mangle_type  # noqa: F401
    except ImportError:
        return False
    launch = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if getattr(self.fn, "__module__", "").startswith("fused_lm_loss."):
            try:
                record = _specialization(self.fn, args, kwargs)
            except Exception as error:  # noqa: BLE001  (never fail a launch: the compile test reports it)
                record = dict(module=self.fn.__module__, kernel=self.fn.__name__, unrecorded=repr(error))
            LAUNCHES.setdefault(json.dumps(record, sort_keys=True), None)
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    _recording = True
    return True


def is_recording() -> bool:
    return _recording


def _specialization(fn, args: tuple, kwargs: dict) -> dict:
    """(module, kernel, signature, constexprs, divisible-by-16 argument names, options) of one launch, as Triton's
    JIT specializes it: constexpr parameters by value; other ints equal to 1, and Nones, become constants."""
    from triton.runtime.jit import mangle_type

    try:  # (the type and the 16-divisibility key, as the JIT computes them; internal, so only where it exists)
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        def specialize(value):
            kind, key = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
            return kind, key == "D"
    except ImportError:
        def specialize(value):
            return mangle_type(value, True), False

    signature = _SIGNATURES.get(fn)
    if signature is None:
        signature = _SIGNATURES[fn] = inspect.signature(fn)
    names = signature.parameters
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    types, constexprs, divisible = {}, {}, []
    for name, value in bound.arguments.items():
        if "constexpr" in str(names[name].annotation):
            types[name], constexprs[name] = "constexpr", _plain(value)
            continue
        kind, by_16 = specialize(value)
        if kind == "constexpr":
            types[name], constexprs[name] = "constexpr", _plain(value)
        else:
            types[name] = kind
            if by_16:
                divisible.append(name)
    options = {k: v for k, v in kwargs.items() if k not in names}
    return dict(module=fn.__module__, kernel=fn.__name__, signature=types, constexprs=constexprs,
                divisible=divisible, options=options)


def _plain(value):
    """A constexpr value as JSON can carry it (the kernels take bools, ints, floats and None); anything else as
    its repr under a key the compile script refuses, so that the test names it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"unrecorded": f"{type(value).__name__}: {value!r}"}
