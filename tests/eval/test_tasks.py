"""The offline tasks: lengths, needles, depths, determinism and scoring."""

from __future__ import annotations

import pytest

from sparse_core.eval.tasks import TASKS, Sample, TaskBuilder, score

LENGTH = 600


@pytest.fixture(scope="module")
def builder(dense_llm) -> TaskBuilder:
    return TaskBuilder(dense_llm.tokenizer, seed=0)


@pytest.mark.parametrize("task", TASKS)
def test_prompts_fill_the_length_and_hold_the_answers(builder, task):
    samples = builder.build(task, LENGTH, 3)
    for s in samples:
        assert 0.9 * LENGTH <= len(s.prompt_ids) <= LENGTH
        text = builder.tokenizer.decode(s.prompt_ids)
        assert all(a in text for a in s.answers), (task, s.answers)
        # The question comes last: the answer's start follows the assistant header.
        assert text.rstrip().endswith(("is", "are", "are:", "they are:"))


def test_samples_are_seeded(dense_llm, builder):
    again = TaskBuilder(dense_llm.tokenizer, seed=0).build("niah_multikey", LENGTH, 2)
    other = TaskBuilder(dense_llm.tokenizer, seed=1).build("niah_multikey", LENGTH, 2)
    first = builder.build("niah_multikey", LENGTH, 2)
    assert [s.prompt_ids for s in first] == [s.prompt_ids for s in again]
    assert [s.prompt_ids for s in first] != [s.prompt_ids for s in other]


def test_needle_depth_moves_the_needle(builder):
    shallow, deep = builder.build("niah_single_english", LENGTH, 2)
    assert (shallow.depth, deep.depth) == (0.0, 1.0)

    def where(s: Sample) -> float:
        text = builder.tokenizer.decode(s.prompt_ids)
        return text.index(s.answers[0]) / len(text)

    assert where(shallow) < 0.3 < 0.7 < where(deep)


def test_score_is_the_fraction_of_answers_found():
    s = Sample("t", 10, 0, None, [1], ["123", "456"], 8, 1)
    assert score(s, "the numbers are 123 and 456") == 1.0
    assert score(s, "only 123") == 0.5
    assert score(s, "12 3") == 0.0


@pytest.mark.parametrize("task", TASKS)
def test_context_len_ends_the_context_before_the_question(builder, task):
    s = builder.build(task, LENGTH, 1)[0]
    context = builder.tokenizer.decode(s.prompt_ids[: s.context_len])
    rest = builder.tokenizer.decode(s.prompt_ids[s.context_len :])
    assert all(a in context for a in s.answers)
    assert rest.lstrip().startswith(("What", "Question")), rest
    assert len(s.prompt_ids) - s.context_len < 100  # the question and the answer's start only


def test_a_length_shorter_than_the_task_text_is_refused(builder):
    with pytest.raises(ValueError, match="cannot hold this task's instruction"):
        builder.build("passkey", 20, 1)


def test_a_base_model_without_a_chat_template_gets_the_plain_text(dense_llm, monkeypatch):
    """`kvsparse calibrate` on a base checkpoint (no chat template): its prompts are the plain
    task text, still of the length asked and with the answers in the context."""
    tokenizer = dense_llm.tokenizer

    def markup(sample: Sample) -> bool:
        return "<|im_start|>user" in tokenizer.decode(sample.prompt_ids, skip_special_tokens=False)

    assert markup(TaskBuilder(tokenizer, seed=0).build("niah_single_english", LENGTH, 1)[0])
    monkeypatch.setattr(type(tokenizer), "has_chat_template", property(lambda self: False))
    for s in TaskBuilder(tokenizer, seed=0).build("niah_single_english", LENGTH, 2):
        assert not markup(s) and 0.9 * LENGTH <= len(s.prompt_ids) <= LENGTH
        assert s.prompt_ids[0] == tokenizer.bos_token_id is not None
        context = tokenizer.decode(s.prompt_ids[: s.context_len])
        assert all(a in context for a in s.answers)
