"""Olmo-core 3's RMSNorm variants against its RMSNorm: QwenRMSNorm and NemotronRMSNorm move one
rounding (the weight multiply happens in the input's dtype instead of fp32), nothing else. In fp32
their outputs and gradients equal RMSNorm's bit for bit, so moecore's RMSNorm (fp32 or f64
throughout) computes each of them; in float64 they differ from RMSNorm by RMSNorm's own internal
fp32 cast (~4e-7), not by a formula.

    /tmp/refenv/bin/python tools/reference/norm_variants_check.py
"""
import torch
from olmo_core.nn.layer_norm import NemotronRMSNorm, QwenRMSNorm, RMSNorm


def main():
    worst = {}
    for dt in (torch.float32, torch.float64):
        x = torch.randn(64, 48, dtype=dt, generator=torch.Generator().manual_seed(0)) * 3
        w = torch.randn(48, dtype=dt, generator=torch.Generator().manual_seed(1))
        g = torch.randn(64, 48, dtype=dt, generator=torch.Generator().manual_seed(2))
        out = {}
        for cls in (RMSNorm, QwenRMSNorm, NemotronRMSNorm):
            n = cls(size=48, eps=1e-5, bias=False, dtype=dt)
            with torch.no_grad():
                n.weight.copy_(w)
            xx = x.clone().requires_grad_(True)
            y = n(xx)
            y.backward(g)
            out[cls.__name__] = (y.detach(), xx.grad, n.weight.grad)
        for name, v in out.items():
            d = max(float((a - b).abs().max()) for a, b in zip(v, out["RMSNorm"]))
            worst[(str(dt), name)] = d
            print(f"{dt} {name:16s} max |difference from RMSNorm| over output, dx, dw: {d:.3g}")
    assert worst[("torch.float32", "QwenRMSNorm")] == 0 and worst[("torch.float32", "NemotronRMSNorm")] == 0


if __name__ == "__main__":
    main()
