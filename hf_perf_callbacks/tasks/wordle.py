"""Offline Wordle task for GRPO demos: word list, game states, prompts and rewards.

Completions are expected as ``<think>reasoning</think><guess>WORD</guess>``. ``REWARD_FUNCS`` holds five rewards,
each in [0, 1] with partial credit (format pieces, a new listed word, letters found, agreement with the earlier
feedback, solved), so that the completions of one prompt differ in reward (GRPO learns only from those differences)
even for a small model's first answers; GRPO sums them (weights 1).
Reward functions follow TRL's signature ``f(prompts, completions, completion_ids=None, **kwargs)``;
the dataset columns ``secret`` and ``history`` arrive as keyword lists, one value per completion.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..core.validation import check_number

if TYPE_CHECKING:
    import datasets

__all__ = [
    "REWARD_FUNCS",
    "consistency_reward",
    "feedback",
    "format_reward",
    "letters_reward",
    "load_words",
    "make_dataset",
    "make_prompt",
    "parse_guess",
    "simulate_history",
    "solved_reward",
    "split_words",
    "valid_word_reward",
]

WORD_LENGTH = 5
MAX_HISTORY = 5
EVAL_FRACTION = 0.1
SPLITS = ("train", "eval")

History = list[dict[str, str]]

_TAG = r"</?(?:think|guess)>"
_BODY = rf"(?:(?!{_TAG}).)*?"
_FULL_FORMAT = re.compile(rf"\s*<think>({_BODY})</think>\s*<guess>({_BODY})</guess>\s*", re.DOTALL)
_GUESS_TAG = re.compile(rf"<guess>({_BODY})</guess>", re.DOTALL)
_WORD = re.compile(rf"[A-Za-z]{{{WORD_LENGTH}}}")
_DECORATION = "\"'`*.,!?;:"
_CAPITAL_WORD = re.compile(rf"\b[A-Z]{{{WORD_LENGTH}}}\b")
EXAMPLE_WORD = "crane"  # the guess in the prompt's example answer


# --------------------------------------------------------------------------- words and scoring


@lru_cache(maxsize=1)
def _word_tuple() -> tuple[str, ...]:
    text = resources.files(__package__).joinpath("wordle_words.txt").read_text(encoding="utf-8")
    return tuple(dict.fromkeys(w.strip().lower() for w in text.splitlines() if w.strip()))


def load_words() -> list[str]:
    """Return the bundled five-letter answer words (lowercase, unique, file order)."""
    return list(_word_tuple())


def feedback(secret: str, guess: str) -> str:
    """Score ``guess`` against ``secret``: ``G`` right place, ``Y`` elsewhere, ``X`` absent or over-counted.

    Repeated letters are handled as in Wordle: greens are matched first, then each remaining
    letter of the secret can turn at most one guess letter yellow, left to right.
    """
    secret, guess = secret.lower(), guess.lower()
    if len(secret) != len(guess):
        raise ValueError(f"secret and guess must have the same length, got {secret!r} and {guess!r}")
    result = ["G" if s == g else "X" for s, g in zip(secret, guess)]
    unmatched = Counter(s for s, r in zip(secret, result) if r == "X")
    for i, g in enumerate(guess):
        if result[i] == "X" and unmatched[g] > 0:
            result[i] = "Y"
            unmatched[g] -= 1
    return "".join(result)


# --------------------------------------------------------------------------- game states and prompts


def split_words(seed: int = 0, eval_fraction: float = EVAL_FRACTION) -> dict[str, list[str]]:
    """Deterministically split the word list into disjoint ``train`` and ``eval`` secret pools."""
    words = load_words()
    random.Random(f"wordle-split-{seed}").shuffle(words)
    n_eval = max(1, round(len(words) * eval_fraction))
    return {"train": sorted(words[n_eval:]), "eval": sorted(words[:n_eval])}


def simulate_history(secret: str, pool: Sequence[str], n_guesses: int, rng: random.Random) -> History:
    """Pick ``n_guesses`` distinct earlier guesses from ``pool`` (never the secret) with their feedback."""
    candidates = [w for w in pool if w != secret]
    guesses = rng.sample(candidates, min(n_guesses, len(candidates)))
    return [{"guess": g, "feedback": feedback(secret, g)} for g in guesses]


def make_prompt(history: Sequence[Mapping[str, str]]) -> str:
    """Render a game state as a short prompt asking for ``<think>…</think><guess>WORD</guess>``, with an example.

    Kept short (about 120 tokens) because every prompt token is recomputed in each GRPO forward; the example answer
    gives a small instruct model the format to start from.
    """
    if history:
        lines = [f"{i}. {h['guess'].upper()} -> {' '.join(h['feedback'])}" for i, h in enumerate(history, 1)]
        state = "Guesses so far:\n" + "\n".join(lines)
    else:
        state = "No guesses yet."
    return (
        "Let's play Wordle. Guess the secret five-letter English word.\n"
        "Feedback per letter: G = right letter, right place; Y = in the word, other place; X = not in the word.\n\n"
        f"{state}\n\n"
        "Think briefly, then give one new five-letter word. Answer format: "
        "<think>your reasoning</think><guess>WORD</guess>\n"
        f"Example: <think>E is in the word, S is not.</think><guess>{EXAMPLE_WORD.upper()}</guess>"
    )


def make_dataset(
    n: int,
    seed: int = 0,
    split: str = "train",
    max_history: int = 3,
    conversational: bool = False,
) -> datasets.Dataset:
    """Build ``n`` seeded Wordle game states.

    Columns: ``prompt`` (str, or ``[{"role": "user", "content": str}]`` when ``conversational``),
    ``secret`` (str) and ``history`` (list of ``{"guess", "feedback"}`` dicts, 0..``max_history`` long).
    Train and eval secrets come from disjoint pools; the same arguments give the same dataset.
    """
    import datasets

    check_number("n", n, low=1, integer=True)
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed: expected {' or '.join(repr(s) for s in SPLITS)}")
    check_number("max_history", max_history, low=0, high=MAX_HISTORY, integer=True)

    pool = split_words(seed)[split]
    rng = random.Random(f"wordle-{split}-{seed}")
    rows: dict[str, list[Any]] = {"prompt": [], "secret": [], "history": []}
    for _ in range(n):
        secret = rng.choice(pool)
        history = simulate_history(secret, pool, rng.randint(0, max_history), rng)
        prompt = make_prompt(history)
        rows["prompt"].append([{"role": "user", "content": prompt}] if conversational else prompt)
        rows["secret"].append(secret)
        rows["history"].append(history)

    text = datasets.Value("string")
    prompt_feature = datasets.List({"role": text, "content": text}) if conversational else text
    history_feature = datasets.List({"guess": text, "feedback": text})
    features = datasets.Features({"prompt": prompt_feature, "secret": text, "history": history_feature})
    return datasets.Dataset.from_dict(rows, features=features)


# --------------------------------------------------------------------------- parsing


def _text(completion: Any) -> str:
    """Completion text from a string or a conversational ``[{"role", "content"}, ...]`` list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion:
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else ""
    return ""


def _history(value: Any) -> History:
    """Normalise a ``history`` value (list of dicts, JSON string or ``None``)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    return [{"guess": h["guess"], "feedback": h["feedback"]} for h in value]


def parse_guess(text: str) -> str | None:
    """Return the lowercase five-letter word in the last ``<guess>`` tag, or ``None``.

    Whitespace, quotes, ``*`` and final punctuation around the word are ignored (``<guess> "Crane." </guess>``).
    """
    tags = _GUESS_TAG.findall(text)
    if not tags:
        return None
    word = tags[-1].strip().strip(_DECORATION)
    return word.lower() if _WORD.fullmatch(word) else None


# --------------------------------------------------------------------------- rewards (see the module docstring)


def format_reward(
    prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
) -> list[float]:
    """0.2 for each of ``<think>``, ``</think>``, ``<guess>``, ``</guess>`` that occurs exactly once (a closing tag
    after its opening one), and 0.2 more for exactly ``<think>…</think><guess>…</guess>`` with non-empty parts and
    nothing around it (so 1.0 means the whole answer is the format: the model stops after the guess)."""
    rewards = []
    for completion in completions:
        text = _text(completion)
        score = 0.0
        for tag in ("think", "guess"):
            opened, closed = text.count(f"<{tag}>"), text.count(f"</{tag}>")
            score += 0.2 * (opened == 1)
            score += 0.2 * (closed == 1 and (opened != 1 or text.index(f"<{tag}>") < text.index(f"</{tag}>")))
        full = _FULL_FORMAT.fullmatch(text)
        if full and full.group(1).strip() and full.group(2).strip():
            score += 0.2
        rewards.append(round(score, 6))
    return rewards


def valid_word_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Any = None,
    *,
    history: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float]:
    """1.0 for a guess from the word list that was not guessed before; 0.5 for any other five-letter guess (a word
    outside the list, or a repeated guess). Without a guess tag: 0.25 when the text names a listed word in capitals
    that is neither an earlier guess nor the prompt's example (a guess in the wrong place), else 0.0."""
    words = frozenset(_word_tuple())
    histories = history if history is not None else [None] * len(completions)
    rewards = []
    for completion, past in zip(completions, histories, strict=True):
        text = _text(completion)
        guess = parse_guess(text)
        earlier = {h["guess"].lower() for h in _history(past)}
        if guess is not None:
            rewards.append(1.0 if guess in words and guess not in earlier else 0.5)
        elif _GUESS_TAG.search(text) is None and any(
                w.lower() in words and w.lower() not in earlier | {EXAMPLE_WORD} for w in _CAPITAL_WORD.findall(text)):
            rewards.append(0.25)
        else:
            rewards.append(0.0)
    return rewards


def letters_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Any = None,
    *,
    secret: Sequence[str],
    **kwargs: Any,
) -> list[float]:
    """Letters of the secret the guess finds: 0.2 per ``G`` and 0.1 per ``Y`` (1.0 for the secret); 0.0 without a
    five-letter guess."""
    rewards = []
    for completion, target in zip(completions, secret, strict=True):
        guess = parse_guess(_text(completion))
        marks = feedback(target, guess) if guess is not None else ""
        rewards.append(round(0.2 * marks.count("G") + 0.1 * marks.count("Y"), 6))
    return rewards


def consistency_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Any = None,
    *,
    history: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float]:
    """How well the guess agrees with the earlier feedback: were it the secret, the share of the earlier feedback
    marks (position by position, over all earlier guesses) that would come out as shown; 1.0 without history, 0.0
    without a five-letter guess."""
    histories = history if history is not None else [None] * len(completions)
    rewards = []
    for completion, past in zip(completions, histories, strict=True):
        guess = parse_guess(_text(completion))
        past = _history(past)
        if guess is None:
            rewards.append(0.0)
        elif not past:
            rewards.append(1.0)
        else:
            agree = sum(a == b for h in past for a, b in zip(feedback(guess, h["guess"]), h["feedback"].upper()))
            rewards.append(round(agree / (WORD_LENGTH * len(past)), 6))
    return rewards


def solved_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Any = None,
    *,
    secret: Sequence[str],
    **kwargs: Any,
) -> list[float]:
    """1.0 when the guess is the secret, else 0.0."""
    return [float(parse_guess(_text(c)) == target.lower()) for c, target in zip(completions, secret, strict=True)]


REWARD_FUNCS = [format_reward, valid_word_reward, letters_reward, consistency_reward, solved_reward]
"""The rewards GRPO sums (each in [0, 1], total at most 5.0)."""
