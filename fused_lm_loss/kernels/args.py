"""Host-side helpers of the kernel launchers: the scalars the kernels take."""
from __future__ import annotations


def scale_args(logit_scale: float, softcap: float | None) -> tuple[float, float, float]:
    """(logit_scale, u_per_x, softcap) as the kernels take them: u_per_x = logit_scale / softcap, divided here
    in float64 and rounded once to fp32 by the launch (kernels/softcap.py). Without softcap the last two
    are 1.0 and unused."""
    logit_scale = float(logit_scale)
    if softcap is None:
        return logit_scale, 1.0, 1.0
    softcap = float(softcap)
    return logit_scale, logit_scale / softcap, softcap

