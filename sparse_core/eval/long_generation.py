"""Fidelity over long generations: teacher-forced top-1 agreement with dense, with and without
decode eviction.

    python -m sparse_core.eval.long_generation [--prompt-len 1000] [--new-tokens 1000]
        [--every 100] [--prompts 3] [--budget 256] [--decode-windows 64,128]

Each prompt is a stretch of the evaluation suite's English text; the next `new_tokens` tokens of
the same text are then fed one per decode step over the compressed cache (`compress_prefix_len`:
only the prompt is prefilled and compressed, as a generation's own tokens would be). After every
`every`-th fed token the engine's greedy choice of the next one is read (a request ending there
with max_tokens=1) for dense and for each sparse setting: agreement is the share of those
choices equal to dense's. Fed text rather than the model's own greedy output, which a small
model turns into loops within a few hundred tokens. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import random

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.eval.haystack import english_text
from sparse_core.models.loader import load_model_source


def text_windows(llm: LLM, num_prompts: int, length: int, seed: int) -> list[list[int]]:
    """`num_prompts` stretches of `length` tokens of the English text, from random starts."""
    ids = llm.tokenizer.encode(english_text(), add_special_tokens=False)
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - length) for _ in range(num_prompts)]
    return [ids[s : s + length] for s in starts]


def greedy_choices(
    llm: LLM, texts: list[list[int]], prompt_len: int, fed: list[int]
) -> tuple[list[int], dict[str, int]]:
    """The greedy next token after prompt + j fed tokens, for every text and every j in `fed`,
    and the tokens per layer group the longest of them held at its end."""
    requests, params = [], []
    for text in texts:
        for j in fed:
            requests.append(text[: prompt_len + j])
            params.append(
                SamplingParams(max_tokens=1, temperature=0.0, compress_prefix_len=prompt_len)
            )
    outs = llm.generate(requests, params)
    return [out.token_ids[0] for out in outs], outs[len(fed) - 1].kv_tokens_held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="read the greedy choice every N tokens")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--decode-windows", default="64,128", help="decode eviction's windows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory-gb", type=float, default=6.0)
    args = p.parse_args(argv)

    source = load_model_source(args.model)
    fed = list(range(0, args.new_tokens + 1, args.every))
    settings = {"snapkv": SparsityConfig(policy="snapkv", budget=args.budget)}
    for w in (int(x) for x in args.decode_windows.split(",") if x):
        settings[f"snapkv + decode eviction (window {w})"] = SparsityConfig(
            policy="snapkv", budget=args.budget, decode_eviction=True, decode_window=w
        )
    results: dict[str, dict] = {}
    reference: list[int] = []
    for name, sparsity in [("dense", SparsityConfig(policy="dense")), *settings.items()]:
        with LLM(
            model_source=source,
            sparsity=sparsity,
            max_model_len=args.prompt_len + args.new_tokens + 8,
            # Every request at once, held whole in the dense run: no preemption recomputes one.
            max_num_seqs=len(fed) * args.prompts,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
        ) as llm:
            texts = text_windows(llm, args.prompts, args.prompt_len + args.new_tokens, args.seed)
            chosen, held = greedy_choices(llm, texts, args.prompt_len, fed)
        if name == "dense":
            reference = chosen
        same = [a == b for a, b in zip(chosen, reference, strict=True)]
        # Per text, its checkpoints past the middle of the fed tokens.
        late = [s for i, s in enumerate(same) if fed[i % len(fed)] > args.new_tokens // 2]
        results[name] = {
            "agreement": round(sum(same) / len(same), 3),
            "agreement_second_half": round(sum(late) / len(late), 3),
            "kv_tokens_held": held,
        }
        print(f"{name}: {results[name]}", flush=True)
    print(json.dumps({"long_generation": vars(args) | {"results": results}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
