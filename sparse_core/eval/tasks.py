"""Seeded long-context tasks built with the model's own tokenizer (RULER-style).

Every prompt is a chat turn (for a model with a chat template; a base model's is the plain text
after its BOS): an instruction, the context (a haystack with needles in it), the question at
the end, then the start of the answer after the assistant header, so that a small instruct
model answers in a form that can be checked by string match. Sent whole, the question
sits in the engine's observation window (the query-aware setting); `context_len` marks where the
question starts, so the runner can have only the part before it compressed (query-agnostic).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from sparse_core.eval.haystack import NOISE, english_text, sentences

TASKS = (
    "passkey",
    "niah_single_noise",
    "niah_single_english",
    "niah_multikey",
    "niah_multivalue",
    "variable_tracking",
    "frequent_words",
)

ADJECTIVES = ("quiet", "brave", "silver", "hollow", "crimson", "gentle", "ancient", "rapid")
NOUNS = ("river", "falcon", "lantern", "meadow", "harbor", "canyon", "violin", "comet")


@dataclass
class Sample:
    task: str
    length: int  # nominal prompt length in tokens (the prompt has at most this many)
    index: int
    depth: float | None  # where the needle sits in the context (0 = start), single-needle tasks
    prompt_ids: list[int]
    answers: list[str]  # every one must appear in the output for full marks
    max_tokens: int
    context_len: int  # prompt tokens before the question (chat header, instruction, context)


def score(sample: Sample, output: str) -> float:
    """RULER's string_match_all: the fraction of expected answers found in the output."""
    text = output.lower()
    return sum(a.lower() in text for a in sample.answers) / len(sample.answers)


@dataclass
class Piece:
    """Context text split into units a needle can go between, with their token counts."""

    units: list[str]
    tokens: list[int]


class TaskBuilder:
    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seed = seed

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    @cached_property
    def english(self) -> Piece:
        units = sentences(english_text())
        return Piece(units, [self.count(" " + u) for u in units])

    @cached_property
    def noise(self) -> Piece:
        return Piece([NOISE], [self.count(" " + NOISE)])

    def build(self, task: str, length: int, num_samples: int) -> list[Sample]:
        make: Callable[[random.Random, int, float], Sample] = getattr(self, f"_{task}")
        out = []
        for i in range(num_samples):
            rng = random.Random(f"{self.seed}-{task}-{length}-{i}")
            depth = i / (num_samples - 1) if num_samples > 1 else 0.5
            out.append(make(rng, length, depth))
            out[-1].index = i
        return out

    # -- shared pieces ----------------------------------------------------------------------

    def _prompt(
        self, instruction: str, context: str, question: str, prefix: str
    ) -> tuple[list[int], int]:
        """The prompt's token ids and how many of them come before the question."""
        head = f"{instruction}\n\n{context}"
        content = f"{head}\n\n{question}"
        # A base model (no chat template) reads the plain text after its BOS (and no EOS a
        # tokenizer might add); a chat template writes its own.
        tokenizer = self.tokenizer
        if tokenizer.has_chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
            bos = []
        else:
            text = f"{content}\n"
            bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        ids = bos + tokenizer.encode(text, add_special_tokens=False)
        ids += tokenizer.encode(prefix, add_special_tokens=False)
        # Tokens of the text up to the end of the context; the few that could merge across the
        # boundary are counted with the question.
        before = bos + tokenizer.encode(
            text[: text.index(head) + len(head)], add_special_tokens=False
        )
        context_len = next(
            (i for i, (a, b) in enumerate(zip(before, ids, strict=False)) if a != b), len(before)
        )
        return ids, context_len

    def _filler(self, piece: Piece, num_tokens: int, rng: random.Random) -> list[str]:
        """Consecutive units (wrapping around) from a random start, about num_tokens in all."""
        start = rng.randrange(len(piece.units))
        units: list[str] = []
        total, i = 0, start
        while total + piece.tokens[i % len(piece.units)] <= num_tokens:
            total += piece.tokens[i % len(piece.units)]
            units.append(piece.units[i % len(piece.units)])
            i += 1
        return units

    def _fit(
        self,
        length: int,
        piece: Piece,
        rng: random.Random,
        needles: list[str],
        depths: list[float],
        instruction: str,
        question: str,
        prefix: str,
    ) -> tuple[list[int], int]:
        """The longest prompt of at most `length` tokens with the needles at the given depths,
        and its context length."""
        overhead = len(self._prompt(instruction, " ".join(needles), question, prefix)[0])
        if overhead > length:
            raise ValueError(
                f"a {length}-token prompt cannot hold this task's instruction, needles and "
                f"question ({overhead} tokens with this tokenizer); ask for longer prompts"
            )
        budget = length - overhead
        while True:
            units = self._filler(piece, max(budget, 0), rng)
            # Insert from the deepest so earlier positions stay valid.
            for needle, depth in sorted(zip(needles, depths, strict=True), key=lambda x: -x[1]):
                units.insert(round(depth * len(units)), needle)
            ids, context_len = self._prompt(instruction, " ".join(units), question, prefix)
            if len(ids) <= length:
                return ids, context_len
            budget -= len(ids) - length + 8  # joins tokenise a little differently; retry shorter

    # -- tasks --------------------------------------------------------------------------------

    def _passkey(self, rng: random.Random, length: int, depth: float) -> Sample:
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        ids, context_len = self._fit(
            length,
            self.noise,
            rng,
            [needle],
            [depth],
            "There is an important info hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the important information there.",
            "What is the pass key?",
            "The pass key is",
        )
        return Sample("passkey", length, 0, depth, ids, [key], 12, context_len)

    def _niah(
        self,
        task: str,
        rng: random.Random,
        length: int,
        depth: float | None,
        piece: Piece,
        num_keys: int = 1,
        num_values: int = 1,
    ) -> Sample:
        keys = rng.sample([f"{a}-{n}" for a in ADJECTIVES for n in NOUNS], num_keys)
        values = [[str(rng.randint(1000000, 9999999)) for _ in range(num_values)] for _ in keys]
        needles = [
            f"One of the special magic numbers for {k} is: {v}."
            for k, vs in zip(keys, values, strict=True)
            for v in vs
        ]
        # The asked needle (the first) at the sample's depth when there is one; the rest anywhere.
        depths = [
            depth if depth is not None and j == 0 else rng.random() for j in range(len(needles))
        ]
        asked = keys[0]
        plural = num_values > 1
        question = (
            f"What are all the special magic numbers for {asked} mentioned in the provided text?"
            if plural
            else f"What is the special magic number for {asked} mentioned in the provided text?"
        )
        prefix = (
            f"The special magic numbers for {asked} mentioned in the provided text are"
            if plural
            else f"The special magic number for {asked} mentioned in the provided text is"
        )
        ids, context_len = self._fit(
            length,
            piece,
            rng,
            needles,
            depths,
            "Some special magic numbers are hidden within the following text. "
            "Make sure to memorize them. I will quiz you about the numbers afterwards.",
            question,
            prefix,
        )
        return Sample(task, length, 0, depth, ids, values[0], 12 * num_values, context_len)

    def _niah_single_noise(self, rng: random.Random, length: int, depth: float) -> Sample:
        return self._niah("niah_single_noise", rng, length, depth, self.noise)

    def _niah_single_english(self, rng: random.Random, length: int, depth: float) -> Sample:
        return self._niah("niah_single_english", rng, length, depth, self.english)

    def _niah_multikey(self, rng: random.Random, length: int, depth: float) -> Sample:
        # The asked key at the sample's depth, three distractor keys elsewhere.
        return self._niah("niah_multikey", rng, length, depth, self.english, num_keys=4)

    def _niah_multivalue(self, rng: random.Random, length: int, depth: float) -> Sample:
        return self._niah(
            "niah_multivalue", rng, length, None, self.english, num_keys=1, num_values=4
        )

    def _variable_tracking(self, rng: random.Random, length: int, depth: float) -> Sample:
        value = str(rng.randint(10000, 99999))
        names = ["".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) for _ in range(5)]
        chain = [f"VAR {names[0]} = {value}."]
        chain += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
        depths = sorted(rng.random() for _ in chain)
        ids, context_len = self._fit(
            length,
            self.noise,
            rng,
            chain,
            depths,
            "Memorize and track the chain(s) of variable assignment hidden in the following text.",
            f"Question: Find all variables that are assigned the value {value} in the text above.",
            f"Answer: According to the chain(s) of variable assignment in the text above, "
            f"{len(names)} variables are assigned the value {value}, they are:",
        )
        return Sample("variable_tracking", length, 0, None, ids, names, 30, context_len)

    def _frequent_words(self, rng: random.Random, length: int, depth: float) -> Sample:
        vocab = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=5)) for _ in range(400)]
        weights = [1 / (r + 1) ** 2 for r in range(len(vocab))]  # Zipf, alpha = 2 (RULER's)
        instruction = (
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words."
        )
        question = (
            "Question: Do not provide any explanation. What are the three most frequently "
            "appeared words in the above coded text?"
        )
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        overhead = len(self._prompt(instruction, "", question, prefix)[0])
        num_words = length - overhead  # at least one token per word: an upper bound
        while True:
            words = rng.choices(vocab, weights=weights, k=num_words)
            ids, context_len = self._prompt(instruction, " ".join(words), question, prefix)
            if len(ids) <= length:
                break
            per_word = (len(ids) - overhead) / num_words
            num_words -= int((len(ids) - length) / per_word) + 1
        counts = {w: words.count(w) for w in set(words)}
        top = sorted(counts, key=lambda w: (-counts[w], w))[:3]
        return Sample("frequent_words", length, 0, None, ids, top, 24, context_len)
