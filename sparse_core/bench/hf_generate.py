"""Peer: Hugging Face transformers `generate` on the same random-weight Llama-3-8B shape.

`python -m sparse_core.bench.hf_generate --batch-size 32` prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from sparse_core.models.config import DUMMY_PRESETS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=500)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = DUMMY_PRESETS[args.preset]
    hf_config = LlamaConfig(
        **{
            k: v
            for k, v in dataclasses.asdict(cfg).items()
            if k not in ("eos_token_ids", "name", "attention_bias")
        }
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.input_len), device="cuda")
    kwargs = dict(do_sample=False, min_new_tokens=args.output_len, max_new_tokens=args.output_len)
    with torch.no_grad():
        model.generate(ids[:, :64], **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids[:, :1], max_new_tokens=1, do_sample=False)
        model.generate(ids, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    new_tokens = (out.shape[1] - args.input_len) * args.batch_size
    print(
        json.dumps(
            {
                "peer": f"transformers generate, batch {args.batch_size}",
                "output_tok_s": round(new_tokens / elapsed, 1),
                "total_tok_s": round((new_tokens + ids.numel()) / elapsed, 1),
                "decode_step_ms": round((elapsed - prefill) / args.output_len * 1e3, 2),
                "prefill_s": round(prefill, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
