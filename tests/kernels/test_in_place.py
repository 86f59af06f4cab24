"""Kernels that write over what they read: the gradient kernels store G in place of the logits (grad_logits,
token_grad, grad_from_exp: same dtype, same offsets), and the divergence writes a 2-byte G over the first half of
each fp32 student row (divergence.py), where G's column j lands on logit j // 2, read by another thread.

Triton orders no global loads and stores across a program's threads. The in-place kernels are safe only where the
load and the store of a block give each thread the same elements (one layout), and the divergence only with a
barrier between each block's loads and its store (``GRAD_OVER_STUDENT``). Neither shows on CPU (the interpreter
runs a whole block as one array operation): the first tests compile the kernels for sm90 (no GPU needed), in a
subprocess without TRITON_INTERPRET, with the launch's 16-divisibility specialization, and read the layouts and
barriers of the TTGIR. The last one checks the launcher asks for the barrier exactly when G shares the student's
memory.
"""
import json

import pytest
import torch

from fused_lm_loss.kernels.args import shares_memory

from ..conftest import requires_triton
from .compile_sm90 import run_script

_COMPILE = r"""
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

FLOATS = {"grad_scale", "factor", "u_per_x", "cap", "smoothing_per_class", "target_weight", "z_loss", "s_factor",
          "s_u_per_x", "s_cap", "t_factor", "t_u_per_x", "t_cap", "beta", "log_beta", "log_one_minus_beta"}
BF16 = {"logits_ptr", "e_ptr", "grad_ptr", "grad_lo_ptr"}
results = []
for module, name, constexprs, grad_dtype in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module("fused_lm_loss.kernels." + module), name)
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):  # (as launched: tensors 16-byte aligned, row strides divisible by 16)
            signature[arg] = ("*" + grad_dtype if arg == "grad_ptr" else "*bf16" if arg in BF16 else
                              "*i64" if "target" in arg and "logit" not in arg else "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in FLOATS:
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if "stride" in arg:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constants = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    ttgir = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ttgir"]
    block = constexprs["BLOCK_V"]  # the accesses of a whole block: (BLOCK_V) or (BLOCK_V / SUB_N, SUB_N) elements
    shape = "%dx" % block if "SUB_N" not in constexprs else "%dx%dx" % (block // constexprs["SUB_N"], constexprs["SUB_N"])
    accesses = re.findall(r"tt\.(load|store) [^\n]*tensor<%s!tt\.ptr<(\w+)>, (#\w+)>" % shape, ttgir)
    results.append(dict(kernel=name, accesses=accesses, barriers=len(re.findall(r"gpu\.barrier|ttg\.barrier", ttgir))))
print("RESULTS " + json.dumps(results))
"""

_DIVERGENCE = dict(S_HAS_SOFTCAP=True, S_HAS_FACTOR=True, T_HAS_SOFTCAP=False, T_HAS_FACTOR=True, MODE=2,
                   NEED_ENTROPY=True, NEED_GRAD=True, HAS_ROW_WEIGHT=True, BLOCK_V=2048)
KERNELS = [  # (module, kernel, constexprs, G's dtype)
    ("grad_logits", "_grad_logits_kernel", dict(HAS_SOFTCAP=True, HAS_FACTOR=True, PER_ROW_SCALE=True, SPLIT=False,
                                                HAS_CLASS_WEIGHT=True, SMOOTH_WEIGHTS=True, BLOCK_V=2048), "bf16"),
    ("grad_logits", "_token_grad_kernel", dict(HAS_SOFTCAP=True, HAS_FACTOR=True, HAS_LOGPROB=True, HAS_ENTROPY=True,
                                               BLOCK_V=2048), "bf16"),
    ("grad_from_exp", "_grad_from_exp_kernel", dict(TILE_N=192, SUB_N=64, PER_ROW_SCALE=True, BLOCK_TILES=1024,
                                                    BLOCK_V=2048), "bf16"),
    ("divergence", "_divergence_kernel", dict(_DIVERGENCE, GRAD_OVER_STUDENT=True), "bf16"),
    ("divergence", "_divergence_kernel", dict(_DIVERGENCE, GRAD_OVER_STUDENT=False), "bf16"),
    ("divergence", "_divergence_kernel", dict(_DIVERGENCE, GRAD_OVER_STUDENT=True), "fp32"),
]


@pytest.fixture(scope="module")
def compiled():
    return run_script(_COMPILE, json.dumps(KERNELS))


def test_in_place_gradients_load_and_store_each_element_in_one_thread(compiled):
    """G over logits of its own dtype: the block's loads and its store of G share one layout (the coalescer may
    give a store and a wider load of one group different ones: triton-lang/triton#10924)."""
    for result in compiled[:3]:
        accesses = result["accesses"]
        assert any(kind == "store" for kind, _, _ in accesses), result
        assert len({layout for _, _, layout in accesses}) == 1, result


def test_the_divergence_orders_its_gradient_stores_after_the_block_loads(compiled):
    """G over the student's logits: a barrier between each block's loads and its store; none without sharing."""
    over_half, apart, over_fp32 = compiled[3:]
    assert over_half["barriers"] == over_fp32["barriers"] == apart["barriers"] + 1, compiled[3:]
    assert len({layout for _, _, layout in over_fp32["accesses"]}) == 1, over_fp32  # (in place: also one layout)


@requires_triton
def test_the_launcher_asks_for_the_barrier_where_g_shares_the_students_memory(monkeypatch):
    from fused_lm_loss.kernels import divergence as module
    from fused_lm_loss.transform import LogitTransform

    asked = []
    kernel = module._divergence_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                asked.append(kwargs["GRAD_OVER_STUDENT"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_divergence_kernel", Spy())
    teacher, rows = torch.randn(3, 40), torch.empty(3)
    for over_student, grad_of in ((False, lambda x_s: torch.empty(3, 40, dtype=torch.bfloat16)),
                                  (True, lambda x_s: x_s.view(torch.bfloat16)[:, :40]),  # divergence.py's half
                                  (True, lambda x_s: x_s)):  # in place
        x_s = torch.randn(3, 40)
        grad_out = grad_of(x_s)
        assert shares_memory(grad_out, x_s) == over_student
        module.divergence_rows(x_s, teacher, rows, None, grad_out, None, student=LogitTransform(),
                               teacher=LogitTransform(), beta=0.0)
        assert asked.pop() == over_student
