"""Checks `moecore export-hf` against transformers and writes the Hugging Face fixtures.

1. Exports the parameters of tests/golden/olmoe_pre.safetensors and olmoe_topk.safetensors with `moecore export-hf` (f32 and bf16),
   loads each with OlmoeForCausalLM.from_pretrained, checks every tensor equals the fixture's
   parameter rounded to that dtype, and compares transformers' logits on the fixture's tokens with
   the fixture's step0 logits (float64, which moecore's golden test matches to 1e-10 on the f64
   path and 1e-5 on the f32 path: so this is the exported model vs moecore's logits).
2. Records the SHA-256 of the exported files and the logit differences in tests/golden/hf_export.json
   (hf_test re-exports in CI and must produce exactly those bytes).
   Token ids: exports olmoe_pre again with `--set data.eos_id=E --set data.bos_id=B --set model.pad_id=P`,
   checks that config.json and generation_config.json carry them as transformers reads them, and that
   generate() stops at the end token: E is the token greedy decoding emits second, so a run of 8 new
   tokens must end after 2 (the first, then E).
3. Writes checkpoints for import tests under tests/golden/hf/:
   (both from olmoe_pre's parameters)
   save_pretrained/: transformers' own save_pretrained in bf16, sharded with a tiny max_shard_size;
   fused/: the model's state_dict as-is (fused experts.gate_up_proj (E, 2F, D), experts.down_proj).

usage: python tools/reference/check_hf_export.py --moecore build/moecore [--write]
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The OLMoE-expressible golden fixtures (olmoe_topk: tied embeddings, norm_topk_prob).
FIXTURES = ["olmoe_pre", "olmoe_topk"]


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def hf_name_map(cfg):
    """our name -> (HF per-expert key or list of them)."""
    m = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
    if not cfg["tie_embeddings"]:
        m["lm_head"] = "lm_head.weight"
    for L in range(cfg["n_layers"]):
        h, p = f"model.layers.{L}.", f"layers.{L}."
        for ours, hf in [("attn_norm", "input_layernorm"), ("wq", "self_attn.q_proj"), ("wk", "self_attn.k_proj"),
                         ("wv", "self_attn.v_proj"), ("wo", "self_attn.o_proj"), ("q_norm", "self_attn.q_norm"),
                         ("k_norm", "self_attn.k_norm"), ("ffn_norm", "post_attention_layernorm"),
                         ("router", "mlp.gate")]:
            m[p + ours] = h + hf + ".weight"
        for ours, hf in [("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")]:
            m[p + "experts." + ours] = [h + f"mlp.experts.{e}.{hf}.weight" for e in range(cfg["num_experts"])]
    return m


def check_token_ids(moecore, tmp, model):
    """Token ids through export: transformers' config, generation config and generate()."""
    from transformers import GenerationConfig, OlmoeForCausalLM
    path = os.path.join(ROOT, "tests/golden/olmoe_pre.safetensors")
    prompt = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    first, second = int(greedy[0, -2]), int(greedy[0, -1])
    eos, bos = second, 1
    pad = next(t for t in range(model.config.vocab_size) if t not in (eos, bos, first))
    out = os.path.join(tmp, "token_ids")
    subprocess.run([moecore, "export-hf", "--from", path, "--out", out, "--set", f"data.eos_id={eos}",
                    "--set", f"data.bos_id={bos}", "--set", f"model.pad_id={pad}"], check=True)
    m = OlmoeForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    g = GenerationConfig.from_pretrained(out)
    ok = (m.config.eos_token_id, m.config.bos_token_id, m.config.pad_token_id) == (eos, bos, pad)
    ok &= (g.eos_token_id, g.bos_token_id, g.pad_token_id) == (eos, bos, pad)
    ok &= m.model.embed_tokens.padding_idx == pad
    with torch.no_grad():
        gen = m.generate(prompt, max_new_tokens=8, do_sample=False)
    new = gen[0, prompt.shape[1]:].tolist()
    ok &= new == [first, eos]
    print(f"token ids: eos {eos} bos {bos} pad {pad}; config {m.config.eos_token_id}/{m.config.bos_token_id}/"
          f"{m.config.pad_token_id}, generation_config {g.eos_token_id}/{g.bos_token_id}/{g.pad_token_id}, "
          f"padding_idx {m.model.embed_tokens.padding_idx}; generate(max_new_tokens=8) -> {new} "
          f"({'stops at eos' if new == [first, eos] else 'DOES NOT STOP'})")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecore", default=os.path.join(ROOT, "build/moecore"))
    ap.add_argument("--write", action="store_true", help="write tests/golden/hf_export.json and tests/golden/hf/")
    args = ap.parse_args()
    from transformers import OlmoeForCausalLM

    tmp = tempfile.mkdtemp()
    record = {"command": "moecore export-hf --from tests/golden/FIXTURE.safetensors --out DIR --dtype DTYPE",
              "transformers": __import__("transformers").__version__, "torch": torch.__version__}
    ok = True
    models = {}
    for fixture in FIXTURES:
        path = os.path.join(ROOT, "tests/golden", fixture + ".safetensors")
        f = safe_open(path, "pt")
        cfg = json.loads(f.metadata()["config"])["model"]
        ids = f.get_tensor("ids").long()
        ref_logits = f.get_tensor("step0.logits")
        params = {k[len("param."):]: f.get_tensor(k) for k in f.keys() if k.startswith("param.")}
        names = hf_name_map(cfg)
        record[fixture] = {}
        for dtype, tdt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
            out = os.path.join(tmp, fixture + "_" + dtype)
            subprocess.run([args.moecore, "export-hf", "--from", path, "--out", out, "--dtype", dtype], check=True)
            # every exported tensor is the fixture's parameter rounded to dtype
            with safe_open(os.path.join(out, "model.safetensors"), "pt") as st:
                keys = set(st.keys())
                want = set()
                for ours, hf in names.items():
                    hfs = hf if isinstance(hf, list) else [hf]
                    want |= set(hfs)
                    got = torch.stack([st.get_tensor(k) for k in hfs]) if isinstance(hf, list) else st.get_tensor(hf)
                    if not torch.equal(got, params[ours].to(tdt)):
                        print(f"{fixture} {dtype}: {ours} differs from the fixture parameter rounded to {tdt}")
                        ok = False
                if keys != want:
                    print(f"{fixture} {dtype}: key sets differ: {sorted(keys ^ want)}")
                    ok = False
            model, info = OlmoeForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                           output_loading_info=True)
            model.eval()
            if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")):
                print(f"{fixture} {dtype}: loading info {info}")
                ok = False
            if fixture == FIXTURES[0]:
                models[dtype] = model
            with torch.no_grad():
                logits = model(ids).logits.double()
            diff = (logits - ref_logits).abs().max().item()
            rel = diff / ref_logits.abs().max().item()
            print(f"{fixture} {dtype}: max |logits(transformers, export) - logits(fixture)| = {diff:.3e} "
                  f"(relative {rel:.3e})")
            record[fixture][dtype] = {"config.json": sha256(os.path.join(out, "config.json")),
                                      "generation_config.json": sha256(os.path.join(out, "generation_config.json")),
                                      "model.safetensors": sha256(os.path.join(out, "model.safetensors")),
                                      "max_abs_logit_diff": diff, "max_rel_logit_diff": rel}
            ok &= rel < (1e-5 if dtype == "f32" else 5e-2)
    ok &= check_token_ids(args.moecore, tmp, models["f32"])
    print(json.dumps(record, indent=2))
    if not ok:
        sys.exit("check failed")
    if args.write:
        with open(os.path.join(ROOT, "tests/golden/hf_export.json"), "w") as fh:
            json.dump(record, fh, indent=2)
            fh.write("\n")
        hf_dir = os.path.join(ROOT, "tests/golden/hf")
        shutil.rmtree(hf_dir, ignore_errors=True)
        # the in-memory fused layout, f32
        m = models["f32"].to(torch.float32)
        fused = os.path.join(hf_dir, "fused")
        os.makedirs(fused)
        sd = {k: v.contiguous() for k, v in m.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd), sorted(sd)
        save_file(sd, os.path.join(fused, "model.safetensors"), metadata={"format": "pt"})
        m.config.save_pretrained(fused)
        # transformers' own save_pretrained, bf16, sharded (after the fused f32 one: .to() is in place)
        m = models["f32"].to(torch.bfloat16)
        m.save_pretrained(os.path.join(hf_dir, "save_pretrained"), max_shard_size="20KB")
        for root, _, files in os.walk(hf_dir):
            for name in sorted(files):
                p = os.path.join(root, name)
                print(os.path.relpath(p, ROOT), os.path.getsize(p))


if __name__ == "__main__":
    main()
