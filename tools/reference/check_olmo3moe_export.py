"""moecore's olmo3moe export, loaded by Olmo-core 3's own Olmo3MoeForCausalLM.

Runs `moecore import-hf` on tests/golden/hf/olmo3moe (a model Olmo-core 3 saved with its own
converter, tools/reference/make_olmo3moe_fixture.py), then `moecore export-hf --format olmo3moe`
twice: carrying the imported config.json and tokenizer (the default), and with --no-carry (a
config.json written from moecore's settings alone, as for a model trained in moecore). Each folder
is loaded with Olmo3MoeForCausalLM.from_pretrained; its logits (float64 arithmetic on the float32
weights) must equal the recorded ones within 1e-12, and every config field as from_pretrained reads
it must equal the original's (the carried export), or differ only in fields that do not change the
function (the fresh export; listed).

Usage: python check_olmo3moe_export.py [--moecore build/moecore]
Loading an olmo3moe folder needs olmo_core installed (transformers ships no olmo3moe class):
`from olmo_core.nn.moe.v2.hf.modeling_olmo3moe import Olmo3MoeForCausalLM`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import olmo3moe_check as O3  # noqa: E402
from safetensors import safe_open  # noqa: E402

F64 = torch.float64
# Fields that do not change what the weights compute: loader settings, the stale top-level
# rope_theta (the model reads rope_parameters), training-only settings, Olmo-core's loading hint.
NO_FUNCTION = {"transformers_version", "rope_theta", "global_load_balancing", "dense_layers_use_shared_expert",
               "use_cache", "dtype", "torch_dtype", "_name_or_path", "initializer_range"}


def logits_of(folder, ids):
    from olmo_core.nn.moe.v2.hf.modeling_olmo3moe import Olmo3MoeForCausalLM
    m = Olmo3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).to(F64)
    m.eval()
    hd = m.config.head_dim
    theta = m.config.rope_parameters["rope_theta"]
    m.model.rotary_embs.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=F64) / hd))
    with O3.hf_patches(), torch.no_grad():
        return m(input_ids=ids.long(), use_cache=False).logits.reshape(-1, m.config.vocab_size), m.config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecore", default=os.path.join(REPO, "build", "moecore"))
    args = ap.parse_args()
    torch.set_default_dtype(F64)
    fixture = os.path.join(REPO, "tests", "golden", "hf", "olmo3moe")
    with safe_open(os.path.join(REPO, "tests", "golden", "hf", "olmo3moe_expected.safetensors"), "pt") as f:
        ids, want = f.get_tensor("ids"), f.get_tensor("logits")
        mbs = json.loads(f.metadata()["config"])["train"]["micro_batch_size"]
    ids = ids[:mbs]
    base_logits, base_cfg = logits_of(fixture, ids)
    assert float((base_logits - want).abs().max() / want.abs().max()) <= 1e-12
    with tempfile.TemporaryDirectory() as tmp:
        params = os.path.join(tmp, "p.safetensors")
        subprocess.run([args.moecore, "import-hf", "--from", fixture, "--out", params], check=True)
        results = {}
        for name, extra in (("carried", []), ("no_carry", ["--no-carry"])):
            out = os.path.join(tmp, name)
            subprocess.run([args.moecore, "export-hf", "--from", params, "--format", "olmo3moe", "--out", out] + extra,
                           check=True)
            lo, cfg = logits_of(out, ids)
            rel = float((lo - want).abs().max() / want.abs().max())
            a, b = base_cfg.to_dict(), cfg.to_dict()
            differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k != "_name_or_path")
            results[name] = dict(logits_rel_to_recorded=rel, config_fields_differing=differ,
                                 files=sorted(os.listdir(out)))
            assert rel <= 1e-12, (name, rel)
            if name == "carried":
                assert not differ, differ
            else:
                assert set(differ) <= NO_FUNCTION, set(differ) - NO_FUNCTION
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
