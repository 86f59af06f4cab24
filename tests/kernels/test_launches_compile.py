"""Every kernel launch the CPU suite made compiles for sm90 (H100 / H200), checked without a GPU.

The suite's launches are recorded under the Triton interpreter (``launches.py``); this test runs after all others
(conftest.py orders it last) and compiles each distinct specialization, in a subprocess without
TRITON_INTERPRET: through Triton's frontend, where type errors are found, and one launch per kernel down to the
cubin. So a kernel the interpreter runs but the compiler refuses fails here, on CPU, before a GPU call. Run alone,
the test first makes one launch of every kernel itself, so it always covers all of them.
"""
import importlib
import json
import pkgutil

import pytest
import torch

import fused_lm_loss
from fused_lm_loss import FusedLMLoss, exp_epilogue, fused_divergence, token_stats

from ..conftest import TEST_DEVICE, requires_triton
from . import launches
from .compile_sm90 import run_script

pytestmark = [requires_triton, pytest.mark.skipif(TEST_DEVICE != "cpu", reason="on a GPU every launch compiles for real")]

_COMPILE = r"""
import json, sys
from concurrent.futures import ProcessPoolExecutor
from tests.kernels.compile_sm90 import compile_launch

launches, full = json.load(open(sys.argv[1])), set(json.loads(sys.argv[2]))
with ProcessPoolExecutor(2) as pool:
    errors = list(pool.map(compile_launch, launches, [i in full for i in range(len(launches))], chunksize=16))
print("RESULTS " + json.dumps(errors))
"""


def _launch_every_kernel(monkeypatch) -> None:
    """One small call through each launcher, so that the test covers every kernel when run alone."""
    hidden = torch.randn(40, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(384, 32, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 384, (40,))  # (384: whole tiles of the Hopper path)
    labels[::7] = -100
    with fused_lm_loss.use_backend("triton"):
        for h, w in ((hidden, weight), (hidden.detach().float().requires_grad_(), weight.detach().float())):
            # statistics, merge, gradient; backward's scaling to bf16, and in place on fp32 gradients
            FusedLMLoss(chunk_size=16, label_smoothing=0.1)(h, w, labels).backward()
        with torch.no_grad():  # the statistics-epilogue matmul (fp16 under the interpreter)
            FusedLMLoss()(hidden.detach().half(), weight.detach().half(), labels)
        out = token_stats(hidden, weight, labels)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        fused_divergence(hidden, weight, hidden.detach(), weight.detach(), labels).backward()
        import fused_lm_loss.kernels as kernels  # the Hopper path, its GEMM's PyTorch twin standing in

        monkeypatch.setattr(kernels, "supports_exp_epilogue", lambda h, w: True)
        monkeypatch.setattr(kernels, "exp_matmul", exp_epilogue.exp_matmul_reference)
        hidden.grad = None
        FusedLMLoss()(hidden, weight, labels).backward()
        from fused_lm_loss.kernels.row_offset import row_offset  # (on the GPU inside exp_matmul, replaced above)

        row_offset(hidden.detach(), weight.detach(), labels.clamp(min=0))


def _every_kernel() -> set:
    """Every @triton.jit kernel of fused_lm_loss.kernels (by convention named ``_..._kernel``)."""
    import fused_lm_loss.kernels as package

    names = set()
    for module in pkgutil.iter_modules(package.__path__):
        if module.name == "exp_gemm":  # the CuTe DSL epilogue: no Triton kernel, and it needs the [hopper] extra
            continue
        namespace = vars(importlib.import_module(f"{package.__name__}.{module.name}"))
        names |= {name for name, value in namespace.items()
                  if name.startswith("_") and name.endswith("_kernel") and hasattr(value, "fn")}
    return names


@pytest.mark.runs_last
def test_every_launch_compiles_for_sm90(monkeypatch, tmp_path):
    if not launches.start_recording():
        pytest.skip("this Triton's interpreter cannot be recorded")
    _launch_every_kernel(monkeypatch)
    recorded = [json.loads(key) for key in launches.LAUNCHES]
    missing = _every_kernel() - {launch["kernel"] for launch in recorded}
    assert not missing, f"kernels never launched: {sorted(missing)}"
    # down to the cubin: per kernel, its launch with the largest blocks (ptxas refuses what does not fit)
    largest = {}
    for i, launch in enumerate(recorded):
        size = sum(v for v in launch.get("constexprs", {}).values() if type(v) is int)
        if launch["kernel"] not in largest or size > largest[launch["kernel"]][0]:
            largest[launch["kernel"]] = (size, i)
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(recorded))
    errors = run_script(_COMPILE, str(path), json.dumps([i for _, i in largest.values()]))
    failed = [(launch["kernel"], launch.get("signature"), launch.get("constexprs"), launch.get("options"), error)
              for launch, error in zip(recorded, errors) if error is not None]
    assert not failed, f"{len(failed)} of {len(recorded)} launches do not compile for sm90, e.g. {failed[:3]}"
