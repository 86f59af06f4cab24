"""The logit transform: what the loss does to the raw logits x = h @ W.T (+ b) before the softmax.

    z = softcap * tanh(scale * x / softcap) / temperature          (with a softcap: Gemma 2/3)
    z = scale * x / temperature                                     (without)

One value object, passed whole through the backend protocol, the plan and the chunk loop; the Triton kernels
apply it with ``kernels/transform.py`` and the PyTorch backend with ``apply`` / ``chain`` below. A temperature is a
scale and a softcap divided by T (softcap(s x) / T = (c / T) tanh((s / T) x / (c / T))), so both take three numbers
(``kernel_args``), folded here once in float64::

    factor = scale / T        cap = softcap / T        u_per_x = factor / cap  (= scale / softcap)
    z = cap * tanh(u_per_x * x),  dz/dx = factor * (1 - tanh(u_per_x * x)**2)        (with a softcap)
    z = factor * x,               dz/dx = factor                                     (without)

Example::

    t = LogitTransform(scale=0.5, softcap=30.0, temperature=0.7)
    z, capped = t.apply(logits)            # fp32 loss-space logits, and tanh(.) for the chain rule
    d_logits = t.chain(d_z, capped)        # d loss / d x from d loss / d z
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @property
    def factor(self) -> float:
        """dz/dx without a softcap: scale / temperature."""
        return float(self.scale) / float(self.temperature)

    @property
    def cap(self) -> float | None:
        """The softcap of z (softcap / temperature), or None."""
        return None if self.softcap is None else float(self.softcap) / float(self.temperature)

    @property
    def has_softcap(self) -> bool:
        return self.softcap is not None

    def kernel_args(self) -> tuple[float, float, float]:
        """(factor, u_per_x, cap) as the kernels take them (each rounded once to fp32 at the launch); without a
        softcap the last two are 1.0 and unused."""
        if self.softcap is None:
            return self.factor, 1.0, 1.0
        return self.factor, self.factor / self.cap, self.cap

    def kernel_flags(self) -> dict[str, bool]:
        """The kernels' constexpr flags for this transform (kernels/transform.py)."""
        return {"HAS_SOFTCAP": self.softcap is not None, "HAS_FACTOR": self.factor != 1.0}

    def without_model_part(self) -> "LogitTransform":
        """What is left to apply to logits that already carry the model's scale and softcap: the temperature."""
        return LogitTransform(temperature=self.temperature)

    # ---- the PyTorch twin of kernels/transform.py ----

    def apply(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 loss-space logits z, tanh(.) for the chain rule or None without a softcap)."""
        z = logits.float() * self.factor
        if self.softcap is None:
            return z, None
        capped = torch.tanh(z / self.cap)
        return capped * self.cap, capped

    def chain(self, grad_z: torch.Tensor, capped: torch.Tensor | None, grad_scale: float = 1.0,
              row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """d/dx from fp32 d/dz (in place on ``grad_z``), times ``grad_scale`` and, per row, ``row_scale``."""
        scale = grad_scale * self.factor
        grad_z *= scale if row_scale is None else (row_scale * scale)[:, None]
        if capped is not None:
            grad_z *= 1.0 - capped * capped
        return grad_z
