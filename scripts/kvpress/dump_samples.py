"""Write the suite's prompts (token ids, answers) to JSON for run_kvpress.py, with the GGUF path
and the token ids our engine stops on (the GGUF's end-of-sequence token).

Runs in the engine's environment: python scripts/kvpress/dump_samples.py OUT.json
    [--tasks ...] [--lengths 500] [--samples 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from sparse_core.eval.tasks import TASKS, TaskBuilder
from sparse_core.models.loader import builtin_model_path, load_model_source


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--lengths", default="500")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = "smollm2-135m-instruct"
    tokenizer = load_model_source(model).tokenizer
    builder = TaskBuilder(tokenizer, seed=args.seed)
    samples = [
        asdict(s)
        for task in args.tasks.split(",")
        for length in map(int, args.lengths.split(","))
        for s in builder.build(task, length, args.samples)
    ]
    with open(args.out, "w") as f:
        json.dump(
            {
                "gguf": builtin_model_path(model),
                "eos_token_ids": list(tokenizer.eos_token_ids),
                "samples": samples,
            },
            f,
        )


if __name__ == "__main__":
    main()
