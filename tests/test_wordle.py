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
        "<guess>crane</guess>",  # missing think
        "<think>unclosed<guess>crane</guess>",  # broken think
        "<think>a</think><think>b</think><guess>crane</guess>",  # two thinks
        "<think></think><guess>crane</guess>",  # empty think
        done("crane") + " trailing text",  # text after the guess
        "<think>x</think><guess>crane",  # unclosed guess
        "<think>x</think><guess>a</guess><guess>b</guess>",  # two guesses
        "<think>x</think><guess> </guess>",  # empty guess
        "crane",  # no tags
        done("notaword"),  # format only: content is not judged
    ]
    assert call(format_reward, completions) == [1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_valid_word_reward() -> None:
    completions = [done("crane"), done("CRANE"), done("zzzzz"), done("cranes"), done("cra")]
    completions += ["<guess>apple", "no tags"]
    assert call(valid_word_reward, completions) == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_consistency_reward() -> None:
    # Secret "crane": earlier guesses and their true feedback.
    history = [{"guess": "slate", "feedback": "XXGXG"}, {"guess": "truck", "feedback": "XGXYX"}]
    completions = [done("crane"), done("grape"), done("apple"), done("nonsense"), done("paper")]
    rewards = call(consistency_reward, completions, history=[history] * len(completions))
    # grape fits slate (XXGXG) but not truck; apple fits neither; paper fits neither.
    assert feedback("grape", "slate") == "XXGXG" and feedback("grape", "truck") != "XGXYX"
    assert rewards == [1.0, 0.5, 0.0, 0.0, 0.0]


def test_consistency_reward_without_history() -> None:
    completions = [done("crane"), done("zzzzz"), "no guess"]
    assert call(consistency_reward, completions, history=[[], [], []]) == [1.0, 1.0, 0.0]
    assert call(consistency_reward, completions) == [1.0, 1.0, 0.0]


def test_consistency_reward_accepts_json_history() -> None:
    history = json.dumps([{"guess": "slate", "feedback": "XXGXG"}])
    assert call(consistency_reward, [done("crane"), done("apple")], history=[history, history]) == [1.0, 0.0]


def test_solved_reward() -> None:
    completions = [done("apple"), done("paper"), done("ample"), done("zzzzz"), done("apples"), "no guess"]
    rewards = call(solved_reward, completions, secret=["apple"] * len(completions))
    # paper -> YYGYX (1 G, 3 Y); ample -> GXGGG (4 G).
    assert rewards == [1.0, 0.5, 0.8, 0.0, 0.0, 0.0]


def test_solved_reward_repeated_letters() -> None:
    rewards = call(solved_reward, [done("babes"), done("bobby")], secret=["abbey", "abbey"])
    assert rewards == [0.6, 0.5]  # YYGGX, YXGXG


def test_conversational_completions() -> None:
    def msg(text: str) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": text}]

    completions = [msg(done("apple")), msg("<guess>zzzzz</guess>"), msg("nothing")]
    history = [[{"guess": "paper", "feedback": "YYGYX"}]] * 3
    assert call(format_reward, completions) == [1.0, 0.5, 0.0]
    assert call(valid_word_reward, completions) == [1.0, 0.5, 0.0]
    assert call(consistency_reward, completions, history=history) == [1.0, 0.0, 0.0]
    assert call(solved_reward, completions, secret=["apple"] * 3) == [1.0, 0.0, 0.0]


def test_reward_funcs_called_like_trl() -> None:
    ds = make_dataset(4, seed=3, max_history=3)
    rows = [ds[i] for i in range(len(ds)) for _ in range(2)]  # two generations per prompt
    completions = [done(r["secret"]) if i % 2 else "garbage" for i, r in enumerate(rows)]
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
    assert len(REWARD_FUNCS) == 4
    for func in REWARD_FUNCS:
        rewards = func(**kwargs)
        assert len(rewards) == len(rows)
        assert all(isinstance(r, float) and 0.0 <= r <= 1.0 for r in rewards)
        assert rewards[1::2] == [1.0] * len(ds)  # the secret is a perfect answer
        assert rewards[0::2] == [0.0] * len(ds)


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
