#!/usr/bin/env python3
"""Tokenize plain text with a Hugging Face `tokenizers` tokenizer into moecore's token format.

The output is OLMo-core's flat format: little-endian uint16 (vocab < 65536) or uint32 token ids,
no header (or a real .npy header with --npy), documents separated by the EOS id. moecore reads
both (data.train_path / data.valid_path, data.token_dtype, data.eos_id).

Tokenizer: either load one (--tokenizer path/to/tokenizer.json, e.g. from a model repository you
already have on disk), or train a small byte-level BPE on the input itself (--train-vocab N); the
trained tokenizer is saved next to the output as <out>.tokenizer.json so later runs can reuse it.

Documents: --docs blank-line (default: paragraphs separated by empty lines), line (one per line)
or file (one per input file). Every document is followed by the EOS id.

Examples:
  python tools/tokenize_hf.py --input corpus.txt --out data/c/train.bin --train-vocab 4096 \\
      --valid-out data/c/valid.bin --valid-every 20
  python tools/tokenize_hf.py --input a.txt b.txt --out data/c/train.npy --npy \\
      --tokenizer /path/to/tokenizer.json --eos "<|endoftext|>"

Requires: pip install tokenizers numpy (not needed by CI).
"""
import argparse
import json
import os
import sys

import numpy as np


def documents(paths, mode):
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if mode == "file":
            if text.strip():
                yield text
        elif mode == "line":
            for line in text.splitlines():
                if line.strip():
                    yield line
        else:
            for para in text.split("\n\n"):
                if para.strip():
                    yield para.strip("\n")


def train_bpe(paths, mode, vocab_size, eos):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(paths, mode), trainer=trainer)
    return tok


def npy_header(dtype, n):
    d = "{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }" % (np.dtype(dtype).str, n)
    pad = (64 - (10 + len(d) + 1) % 64) % 64
    d = d + " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + len(d).to_bytes(2, "little") + d.encode("latin1")


class Writer:
    """Streams token ids to a flat file; with npy=True, a 1-D .npy header is written at the end."""

    def __init__(self, path, dtype, npy):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self.dtype, self.npy, self.n = path, dtype, npy, 0
        self.f = open(path + ".tmp", "wb")

    def write(self, ids):
        a = np.asarray(ids, dtype=self.dtype)
        self.f.write(a.astype(np.dtype(self.dtype).newbyteorder("<"), copy=False).tobytes())
        self.n += a.size

    def close(self):
        self.f.close()
        if self.npy:
            with open(self.path, "wb") as out, open(self.path + ".tmp", "rb") as src:
                out.write(npy_header(self.dtype, self.n))
                while True:
                    chunk = src.read(1 << 24)
                    if not chunk:
                        break
                    out.write(chunk)
            os.remove(self.path + ".tmp")
        else:
            os.replace(self.path + ".tmp", self.path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="UTF-8 text files")
    ap.add_argument("--out", required=True, help="output token file (training split)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", help="tokenizer.json to load")
    src.add_argument("--train-vocab", type=int, help="train a byte-level BPE of this vocabulary size on the input")
    ap.add_argument("--eos", default="<|endoftext|>", help="EOS token string (added as a special token if missing)")
    ap.add_argument("--docs", choices=["blank-line", "line", "file"], default="blank-line", help="document boundaries")
    ap.add_argument("--valid-out", help="optional validation token file")
    ap.add_argument("--valid-every", type=int, default=0, help="every N-th document goes to --valid-out")
    ap.add_argument("--npy", action="store_true", help="write real .npy files (header) instead of flat arrays")
    args = ap.parse_args()

    from tokenizers import Tokenizer

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.tokenizer:
        tok = Tokenizer.from_file(args.tokenizer)
        if tok.token_to_id(args.eos) is None:
            tok.add_special_tokens([args.eos])
    else:
        tok = train_bpe(args.input, args.docs, args.train_vocab, args.eos)
        tok.save(args.out + ".tokenizer.json")
    eos_id = tok.token_to_id(args.eos)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab < 65536 else np.uint32
    if args.valid_out and args.valid_every <= 0:
        sys.exit("--valid-out needs --valid-every N > 0")

    train = Writer(args.out, dtype, args.npy)
    valid = Writer(args.valid_out, dtype, args.npy) if args.valid_out else None
    batch, ndocs = [], 0

    def flush():
        for i, enc in enumerate(tok.encode_batch([d for _, d in batch], add_special_tokens=False)):
            w = valid if (valid and batch[i][0] % args.valid_every == args.valid_every - 1) else train
            w.write(enc.ids + [eos_id])
        batch.clear()

    for doc in documents(args.input, args.docs):
        batch.append((ndocs, doc))
        ndocs += 1
        if len(batch) == 1024:
            flush()
    flush()
    train.close()
    if valid:
        valid.close()
    name = "uint16" if dtype == np.uint16 else "uint32"
    report = {"documents": ndocs, "train_tokens": train.n, "valid_tokens": valid.n if valid else 0,
              "vocab_size": vocab, "eos_id": eos_id, "token_dtype": name}
    print(json.dumps(report))
    print("moecore config: --set model.vocab_size=%d --set data.token_dtype=%s --set data.eos_id=%d "
          "--set data.train_path=%s%s" % (vocab, name, eos_id, args.out,
                                           " --set data.valid_path=" + args.valid_out if valid else ""))


if __name__ == "__main__":
    main()
