"""Tests for the bundled offline Wordle task."""

from __future__ import annotations

import json
import re

import pytest

from hf_perf_callbacks.tasks import wordle
from hf_perf_callbacks.tasks.wordle import (
    REWARD_FUNCS,
    consistency_reward,
    feedback,
    format_reward,
    letters_reward,
    load_words,
    make_dataset,
    parse_guess,
    solved_reward,
    split_words,
    valid_word_reward,
)


def done(guess: str, think: str = "reasoning") -> str:
    return f"<think>{think}</think><guess>{guess}</guess>"


def call(func, completions, **columns):
    return func(prompts=["p"] * len(completions), completions=completions, **columns)


# --------------------------------------------------------------------------- word list


def test_word_list() -> None:
    words = load_words()
    assert 300 <= len(words) <= 500
    assert len(set(words)) == len(words)
    assert all(re.fullmatch(r"[a-z]{5}", w) for w in words)
    assert {"apple", "crane", "paper"} <= set(words)


# --------------------------------------------------------------------------- feedback


@pytest.mark.parametrize(
    ("secret", "guess", "expected"),
    [
        ("apple", "apple", "GGGGG"),
        ("apple", "paper", "YYGYX"),
        ("abbey", "babes", "YYGGX"),
        ("abbey", "bobby", "YXGXG"),
        ("crane", "eerie", "XXYXG"),
        ("crane", "truck", "XGXYX"),
        ("speed", "erase", "YXXYY"),
        ("sheep", "eeeee", "XXGGX"),
        ("lever", "eerie", "YGYXX"),
        ("CRANE", "Crane", "GGGGG"),
    ],
)
def test_feedback(secret: str, guess: str, expected: str) -> None:
    assert feedback(secret, guess) == expected


def test_feedback_length_mismatch() -> None:
    with pytest.raises(ValueError, match="same length"):
        feedback("apple", "pear")


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (done("CRANE"), "crane"),
        ("<guess> slate </guess>", "slate"),
        ("<guess>apple</guess> then <guess>pearl</guess>", "pearl"),
        (done("cranes"), None),
        (done("cr4ne"), None),
        (done("two words"), None),
        ("<guess>crane", None),
        ("crane", None),
        ("", None),
    ],
)
def test_parse_guess(text: str, expected: str | None) -> None:
    assert parse_guess(text) == expected


# --------------------------------------------------------------------------- rewards


def test_format_reward() -> None:
    completions = [
        done("crane"),  # well formed
        "  <think>\nlet me see\n</think>\n<guess>crane</guess>\n",  # whitespace is fine
        "<guess>crane</guess>",  # missing think: two pieces
        "<think>unclosed<guess>crane</guess>",  # three pieces
        "<think>a</think><think>b</think><guess>crane</guess>",  # two thinks: those pieces count nothing
        "<think></think><guess>crane</guess>",  # all pieces, but an empty think is not the format
        done("crane") + " trailing text",  # all pieces, but text after the guess
        "<think>x</think><guess>crane",  # unclosed guess
        "<think>x</think><guess>a</guess><guess>b</guess>",  # two guesses
        "<think>x</think><guess> </guess>",  # empty guess
        "</think>x<think> <guess>crane</guess>",  # a closing tag before its opening one
        "crane",  # no tags
        done("notaword"),  # format only: content is not judged
    ]
    assert call(format_reward, completions) == [1.0, 1.0, 0.4, 0.6, 0.4, 0.8, 0.8, 0.6, 0.4, 0.8, 0.6, 0.0, 1.0]


def test_valid_word_reward() -> None:
    completions = [done("crane"), done("CRANE"), done("zzzzz"), done("cranes"), done("cra")]
    completions += ["<guess>apple", "no tags", '<guess> "Crane." </guess>']
    assert call(valid_word_reward, completions) == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_valid_word_reward_untagged_word() -> None:
    # A listed word in capitals outside the tags is a guess in the wrong place: a little credit, so that a small
    # model's prose answers already differ. Not for the prompt's example, an earlier guess, lowercase or unlisted.
    history = [{"guess": "polar", "feedback": "GXXXX"}]
    completions = ["Here is my answer: BRAIN", "Like the example, CRANE.", "It is POLAR", "a brain", "ZZZZZ",
                   "BRAIN <guess>no</guess>"]
    assert call(valid_word_reward, completions, history=[history] * 6) == [0.25, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_valid_word_reward_repeated_guess() -> None:
    history = [{"guess": "crane", "feedback": "XXXXX"}]
    rewards = call(valid_word_reward, [done("CRANE"), done("apple")], history=[history, history])
    assert rewards == [0.5, 1.0]  # a guess already made teaches nothing new


def test_consistency_reward() -> None:
    # Secret "crane": earlier guesses and their true feedback.
    history = [{"guess": "slate", "feedback": "XXGXG"}, {"guess": "truck", "feedback": "XGXYX"}]
    completions = [done("crane"), done("grape"), done("apple"), done("nonsense"), done("paper")]
    rewards = call(consistency_reward, completions, history=[history] * len(completions))
    # Were it the secret: grape gives slate XXGXG (5 of 5 marks) and truck XGXXX (4 of 5);
    # apple gives XYYXG (3) and XXXXX (3); paper gives XXYXY (3) and XYXXX (3).
    assert [feedback("grape", "slate"), feedback("grape", "truck")] == ["XXGXG", "XGXXX"]
    assert [feedback("apple", "slate"), feedback("apple", "truck")] == ["XYYXG", "XXXXX"]
    assert [feedback("paper", "slate"), feedback("paper", "truck")] == ["XXYXY", "XYXXX"]
    assert rewards == [1.0, 0.9, 0.6, 0.0, 0.6]


def test_consistency_reward_without_history() -> None:
    completions = [done("crane"), done("zzzzz"), "no guess"]
    assert call(consistency_reward, completions, history=[[], [], []]) == [1.0, 1.0, 0.0]
    assert call(consistency_reward, completions) == [1.0, 1.0, 0.0]


def test_consistency_reward_accepts_json_history() -> None:
    history = json.dumps([{"guess": "slate", "feedback": "XXGXG"}])
    # apple would give slate XYYXG: 3 of the 5 marks shown.
    assert call(consistency_reward, [done("crane"), done("apple")], history=[history, history]) == [1.0, 0.6]


def test_letters_reward() -> None:
    completions = [done("apple"), done("paper"), done("ample"), done("zzzzz"), done("apples"), "no guess"]
    rewards = call(letters_reward, completions, secret=["apple"] * len(completions))
    # paper -> YYGYX (1 G, 3 Y); ample -> GXGGG (4 G).
    assert rewards == [1.0, 0.5, 0.8, 0.0, 0.0, 0.0]


def test_letters_reward_repeated_letters() -> None:
    rewards = call(letters_reward, [done("babes"), done("bobby")], secret=["abbey", "abbey"])
    assert rewards == [0.6, 0.5]  # YYGGX, YXGXG


def test_solved_reward() -> None:
    completions = [done("apple"), done("APPLE"), done("ample"), "apple", "no guess"]
    assert call(solved_reward, completions, secret=["apple"] * len(completions)) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_conversational_completions() -> None:
    def msg(text: str) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": text}]

    completions = [msg(done("apple")), msg("<guess>zzzzz</guess>"), msg("nothing")]
    history = [[{"guess": "paper", "feedback": "YYGYX"}]] * 3
    assert call(format_reward, completions) == [1.0, 0.4, 0.0]
    assert call(valid_word_reward, completions, history=history) == [1.0, 0.5, 0.0]
    assert call(consistency_reward, completions, history=history) == [1.0, 0.2, 0.0]  # zzzzz: XXXXX, 1 of 5
    assert call(letters_reward, completions, secret=["apple"] * 3) == [1.0, 0.0, 0.0]
    assert call(solved_reward, completions, secret=["apple"] * 3) == [1.0, 0.0, 0.0]


def total_rewards(completions: list[str], secret: str, history: list[dict[str, str]]) -> list[float]:
    n = len(completions)
    columns = {"secret": [secret] * n, "history": [history] * n}
    per_func = [call(func, completions, **columns) for func in REWARD_FUNCS]
    return [round(sum(values), 6) for values in zip(*per_func)]


def test_partial_credit_climbs_from_a_small_models_first_answers() -> None:
    # Kinds of answer SmolLM2-135M-Instruct gives at first, each a step closer to a good one: every step pays more,
    # so completions of one prompt differ in reward and GRPO has a gradient from the start.
    history = [{"guess": "polar", "feedback": "GXXXX"}]
    ladder = [
        "The word is GXXX.",  # prose, no tags
        "The word is BRAIN.",  # a listed word, outside the tags
        "<guess>the answer</guess>",  # a guess tag, no five-letter word
        "<think>P is first</think><guess>WORD</guess> done",  # all tags, not a word, text after
        "<think>P is first</think><guess>POLAR</guess>",  # the format, but repeats the earlier guess
        "<think>P is first</think><guess>zzzzz</guess>",  # five letters, not a listed word
        "<think>P is first</think><guess>crane</guess>",  # a listed word, ignores P
        "<think>P is first</think><guess>plane</guess>",  # keeps P, finds N and E
        "<think>P is first</think><guess>penny</guess>",  # the secret
    ]
    totals = total_rewards(ladder, "penny", history)
    assert totals == sorted(totals) and len(set(totals)) == len(totals), totals
    assert totals[0] == 0.0 and totals[-1] == 5.0


def test_reward_funcs_called_like_trl() -> None:
    ds = make_dataset(4, seed=3, max_history=3, conversational=True)
    rows = [ds[i] for i in range(len(ds)) for _ in range(2)]  # two generations per prompt
    completions = [[{"role": "assistant", "content": done(r["secret"]) if i % 2 else "garbage"}]
                   for i, r in enumerate(rows)]
    kwargs = {
        "prompts": [r["prompt"] for r in rows],
        "completions": completions,
        "completion_ids": [[1, 2, 3]] * len(rows),
        "secret": [r["secret"] for r in rows],
        "history": [r["history"] for r in rows],
        "trainer_state": None,
        "log_extra": None,
        "log_metric": None,
    }
    assert [f.__name__ for f in REWARD_FUNCS] == [
        "format_reward", "valid_word_reward", "letters_reward", "consistency_reward", "solved_reward"]
    for func in REWARD_FUNCS:
        rewards = func(**kwargs)
        assert len(rewards) == len(rows)
        assert all(isinstance(r, float) and 0.0 <= r <= 1.0 for r in rewards)
        assert rewards[1::2] == [1.0] * len(ds)  # the secret is a perfect answer
        assert rewards[0::2] == [0.0] * len(ds)


def test_recipe_launcher_uses_the_same_rewards() -> None:
    import importlib

    from hf_perf_callbacks.train.arguments import RecipeArguments

    paths = [p.rpartition(".") for p in RecipeArguments().reward_funcs]
    assert [getattr(importlib.import_module(module), name) for module, _, name in paths] == REWARD_FUNCS


# --------------------------------------------------------------------------- dataset


def test_make_dataset_columns() -> None:
    ds = make_dataset(20, seed=1, max_history=5)
    assert ds.column_names == ["prompt", "secret", "history"]
    assert len(ds) == 20
    words = set(load_words())
    for row in ds:
        assert isinstance(row["prompt"], str) and "<guess>WORD</guess>" in row["prompt"]
        assert row["secret"] in words
        assert 0 <= len(row["history"]) <= 5
        for i, h in enumerate(row["history"], start=1):
            assert h["guess"] != row["secret"]
            assert h["feedback"] == feedback(row["secret"], h["guess"])
            assert f"{i}. {h['guess'].upper()} -> {' '.join(h['feedback'])}" in row["prompt"]
        if not row["history"]:
            assert "No guesses yet." in row["prompt"]


def test_make_dataset_conversational() -> None:
    plain = make_dataset(5, seed=2)
    conv = make_dataset(5, seed=2, conversational=True)
    assert conv["prompt"] == [[{"role": "user", "content": p}] for p in plain["prompt"]]
    assert conv["secret"] == plain["secret"]


def test_make_dataset_no_history() -> None:
    ds = make_dataset(10, max_history=0)
    assert all(h == [] for h in ds["history"])


def test_make_dataset_deterministic() -> None:
    assert make_dataset(30, seed=7).to_list() == make_dataset(30, seed=7).to_list()
    assert make_dataset(30, seed=7).to_list() != make_dataset(30, seed=8).to_list()


def test_train_eval_disjoint() -> None:
    for seed in (0, 1):
        pools = split_words(seed)
        assert pools["train"] and pools["eval"]
        assert not set(pools["train"]) & set(pools["eval"])
        assert set(pools["train"]) | set(pools["eval"]) == set(load_words())
        train = set(make_dataset(300, seed=seed, split="train")["secret"])
        evals = set(make_dataset(100, seed=seed, split="eval")["secret"])
        assert train and evals and not train & evals
        assert evals <= set(pools["eval"])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n=0"),
        ({"n": -3}, "n=-3"),
        ({"n": 1, "split": "test"}, "split='test'"),
        ({"n": 1, "max_history": 6}, "max_history=6"),
        ({"n": 1, "max_history": -1}, "max_history=-1"),
    ],
)
def test_make_dataset_validation(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(name)) as err:
        make_dataset(**kwargs)
    assert "allowed" in str(err.value)


def test_no_hub_access(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert len(make_dataset(3)) == 3
    assert wordle.load_words() == load_words()
