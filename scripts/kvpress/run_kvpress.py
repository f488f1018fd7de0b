"""Run kvpress's SnapKV / PyramidKV / StreamingLLM presses on the same prompts (query-aware).

Runs in the kvpress environment (setup.sh), without importing sparse_core:
    python scripts/kvpress/run_kvpress.py SAMPLES.json OUT.json [--ratios 2,4,8]
        [--budget-profiles DIR --budget-ratios 2,3,4]
With --budget-profiles, SnapKV also runs with the per-layer ratios of our calibrated profiles
(DIR/<R>x.json, field layer_ratios) through kvpress's PerLayerCompressionPress: a layer of ratio r
removes the fraction 1 - 1/r of the prompt, a null (whole) layer removes nothing. Those configs are
named snapkv-budgets@<R>x, as in `kvsparse eval --layer-budgets auto`, so compare.py pairs them.
Each prompt is prefilled under the press (`with press(model): model(prompt)`), so the question at
the end of the prompt is inside SnapKV's observation window, as in our engine; then a greedy loop
decodes with positions continuing from the prompt length. (`model.generate` under a press breaks
for PyramidKV: its 2-D attention mask cannot fit layers of different cache lengths.)
Results have the fields of sparse_core.eval.runner.SampleResult.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from kvpress import PerLayerCompressionPress, PyramidKVPress, SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

PRESSES = {"snapkv": SnapKVPress, "pyramid": PyramidKVPress, "streamingllm": StreamingLLMPress}


def make_press(policy: str, ratio: float):
    # kvpress's compression_ratio is the fraction of tokens removed: 2x -> 0.5.
    press = PRESSES[policy](compression_ratio=1 - 1 / ratio)
    if policy in ("snapkv", "pyramid"):
        # Our engine's window is 32 with kernel 7 (kvpress defaults: 64 and 5).
        press.window_size, press.kernel_size = 32, 7
    return press


def load_layer_ratios(profiles: str, ratio: float) -> list[float | None]:
    """The per-layer ratios (None: the layer stays whole) of our profile for `ratio`."""
    return json.loads((Path(profiles) / f"{ratio:g}x.json").read_text())["layer_ratios"]


def make_budget_press(layer_ratios: list[float | None]):
    # PerLayerCompressionPress sets the wrapped press's compression_ratio per layer (module.layer_idx)
    # for that layer's forward hook; 0 leaves the layer untouched.
    inner = make_press("snapkv", 2.0)  # the ratio here is replaced in every layer
    return PerLayerCompressionPress(
        press=inner, compression_ratios=[0.0 if r is None else 1 - 1 / r for r in layer_ratios]
    )


def kept_compression(layer_ratios: list[float | None], n: int) -> float:
    """Compression over all layers of what kvpress keeps of an n-token prompt (its int(n / r))."""
    kept = sum(n if r is None else max(1, int(n * (1 / r))) for r in layer_ratios)
    return len(layer_ratios) * n / kept


@torch.no_grad()
def greedy(model, ids: torch.Tensor, max_tokens: int, press, eos: set[int]) -> list[int]:
    cache = DynamicCache()
    if press is None:
        logits = model(ids, past_key_values=cache).logits
    else:
        with press(model):
            logits = model(ids, past_key_values=cache).logits
    out: list[int] = []
    for step in range(max_tokens):
        token = int(logits[0, -1].argmax())
        if token in eos:
            break
        out.append(token)
        position = torch.tensor([[ids.shape[1] + step]])
        logits = model(
            torch.tensor([[token]]),
            past_key_values=cache,
            position_ids=position,
            cache_position=position[0],
        ).logits
    return out


def score(answers: list[str], text: str) -> float:
    return sum(a.lower() in text.lower() for a in answers) / len(answers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("samples")
    p.add_argument("out")
    p.add_argument("--ratios", default="2,4,8")
    p.add_argument("--policies", default="dense,snapkv,pyramid,streamingllm")
    p.add_argument("--budget-profiles", help="directory of per-layer budget profiles (<R>x.json)")
    p.add_argument("--budget-ratios", default="2,3,4", help="profiles to run from that directory")
    args = p.parse_args()
    data = json.loads(Path(args.samples).read_text())
    path = data["gguf"]
    kw = {"gguf_file": os.path.basename(path)}
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), **kw)
    # Stop where our engine stops: transformers' GGUF tokenizer reports <|im_start|> as SmolLM2's
    # end-of-sequence token, the GGUF metadata <|im_end|>.
    eos = set(data.get("eos_token_ids") or [tok.eos_token_id])
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), dtype=torch.float32, attn_implementation="sdpa", **kw
    ).eval()
    configs = [
        (policy, ratio)
        for policy in args.policies.split(",")
        if policy
        for ratio in ([None] if policy == "dense" else [float(r) for r in args.ratios.split(",")])
    ]
    if args.budget_profiles:
        configs += [("snapkv-budgets", float(r)) for r in args.budget_ratios.split(",")]
    results = []
    for policy, ratio in configs:
        name = policy if ratio is None else f"{policy}@{ratio:g}x"
        layer_ratios = (
            load_layer_ratios(args.budget_profiles, ratio) if "budgets" in policy else None
        )
        for s in data["samples"]:
            ids = torch.tensor([s["prompt_ids"]])
            if ratio is None:
                press, compression = None, 1.0
            elif layer_ratios is not None:
                press = make_budget_press(layer_ratios)
                compression = kept_compression(layer_ratios, ids.shape[1])
            else:
                press, compression = make_press(policy, ratio), ratio
            new = greedy(model, ids, s["max_tokens"], press, eos)
            text = tok.decode(new, skip_special_tokens=True)
            results.append(
                {
                    "config": name,
                    "task": s["task"],
                    "length": s["length"],
                    "index": s["index"],
                    "depth": s["depth"],
                    "prompt_tokens": ids.shape[1],
                    "score": score(s["answers"], text),
                    "compression": compression,
                    "output": text,
                }
            )
        print(name, sum(r["score"] for r in results if r["config"] == name), flush=True)
        Path(args.out).write_text(json.dumps(results))  # after each config: partial runs count


if __name__ == "__main__":
    main()
