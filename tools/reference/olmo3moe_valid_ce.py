"""Validation cross-entropy of an olmo3moe folder in Olmo-core 3's own Olmo3MoeForCausalLM (float64
arithmetic on its weights), over a token file cut as moecore's TokenDataset cuts it (consecutive
seq_len windows, labels shifted inside each, the last position unlabelled): compare with
`moecore eval --checkpoint ...` on the checkpoint the folder was exported from.

Usage: python olmo3moe_valid_ce.py DIR data/kjv/valid.bin [--seq-len 256] [--dtype uint16]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import olmo3moe_check as O3  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("tokens")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dtype", default="uint16")
    args = ap.parse_args()
    from olmo_core.nn.moe.v2.hf.modeling_olmo3moe import Olmo3MoeForCausalLM
    torch.set_default_dtype(torch.float64)
    m = Olmo3MoeForCausalLM.from_pretrained(args.folder, dtype=torch.float32).to(torch.float64).eval()
    if m.model.rotary_embs is not None:  # float64 inverse frequencies
        hd, theta = m.config.head_dim, m.config.rope_parameters["rope_theta"]
        m.model.rotary_embs.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    tok = np.fromfile(args.tokens, dtype=np.dtype(args.dtype)).astype(np.int64)
    S = args.seq_len
    n = len(tok) // S
    ids = torch.from_numpy(tok[: n * S].reshape(n, S))
    total, count = 0.0, 0
    with O3.hf_patches(), torch.no_grad():
        for i in range(0, n, 64):
            x = ids[i:i + 64]
            logits = m(input_ids=x, use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
            total += float(-lp.sum())
            count += lp.numel()
    print(f"Olmo3MoeForCausalLM validation CE {total / count:.10f} nats/token over {count} tokens")


if __name__ == "__main__":
    main()
