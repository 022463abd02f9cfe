"""Synthetic passkey retrieval (no download): can the model recall a number hidden in filler text?

Prompt for a context of about ``L`` tokens and a depth ``δ ∈ [0, 1]``:

    INTRO + filler[: δ·m] + "The pass key is NNNNN. Remember it. NNNNN is the pass key. "
          + filler[δ·m :] + "What is the pass key? The pass key is"

where the filler repeats ``FILLER`` sentences so that the whole prompt is close to ``L`` tokens.
The model continues greedily for ``max_new_tokens``; a trial is correct when the first run of digits
in the continuation equals NNNNN. Accuracy is reported per context length, per depth, per
(length, depth) cell and overall.

Multi-key (``keys = K > 1``): K needles "The pass key of the <label> door is NNNNN. ..." with
distinct labels and random keys; the asked one sits at ``depth``, the others at random depths; the
question names the asked label ("What is the pass key of the <label> door? The pass key of the
<label> door is"). Only the asked key counts as correct (another needle's key is wrong).
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["FILLER", "LABELS", "passkey_prompt", "multikey_prompt", "passkey_trial", "passkey_accuracy",
           "RetrievalProbe", "retrieval_probes"]

INTRO = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


LABELS = ("red", "blue", "green", "yellow", "white", "black", "silver", "golden")


def _filler_repeats(tokenizer, context_tokens: int, fixed_text: str) -> int:
    """How many ``FILLER`` sentences bring ``fixed_text`` (intro, needles, question) to about ``context_tokens``."""
    fixed = len(tokenizer.encode(fixed_text, add_special_tokens=False))
    per_filler = max(1, len(tokenizer.encode(FILLER, add_special_tokens=False)))
    return max(1, (context_tokens - fixed) // per_filler)


def _needle(passkey: str) -> str:
    return f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "


def _labelled_needle(label: str, passkey: str) -> str:
    return f"The pass key of the {label} door is {passkey}. Remember it. "


def _labelled_question(label: str) -> str:
    return f"What is the pass key of the {label} door? The pass key of the {label} door is"


def multikey_prompt(tokenizer, context_tokens: int, needles: list[tuple[str, str, float]], asked: str) -> str:
    """≈ ``context_tokens`` tokens of filler with labelled needles ``(label, passkey, depth)``; asks for ``asked``."""
    if any(not 0.0 <= depth <= 1.0 for _, _, depth in needles):
        raise ValueError(f"depths must lie in [0, 1], got {[d for _, _, d in needles]}")
    text = "".join(_labelled_needle(label, key) for label, key, _ in needles)
    repeats = _filler_repeats(tokenizer, context_tokens, INTRO + text + _labelled_question(asked))
    slots = sorted((round(depth * repeats), index) for index, (_, _, depth) in enumerate(needles))
    parts, done = [INTRO], 0
    for at, index in slots:
        label, key, _ = needles[index]
        parts += [FILLER * (at - done), _labelled_needle(label, key)]
        done = at
    return "".join(parts) + FILLER * (repeats - done) + _labelled_question(asked)


def passkey_prompt(tokenizer, context_tokens: int, depth: float, passkey: str) -> str:
    """The prompt text (≈ ``context_tokens`` tokens) with the needle after ``depth`` of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    repeats = _filler_repeats(tokenizer, context_tokens, INTRO + _needle(passkey) + QUESTION)
    before = round(depth * repeats)
    return INTRO + FILLER * before + _needle(passkey) + FILLER * (repeats - before) + QUESTION


@torch.no_grad()
def passkey_trial(model: nn.Module, tokenizer, context_tokens: int, depth: float, passkey: str,
                  max_new_tokens: int = 8, text: str | None = None) -> dict:
    """One greedy trial: ``{"correct", "answer", "prompt_tokens"}`` (``text``: a prompt made elsewhere)."""
    text = text if text is not None else passkey_prompt(tokenizer, context_tokens, depth, passkey)
    inputs = tokenizer(text, return_tensors="pt")
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                            else tokenizer.eos_token_id)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    # Some tokenizers decode digit tokens with spaces between them ("1 2 3"): join such runs first.
    digits = re.search(r"\d+", re.sub(r"(?<=\d)\s+(?=\d)", "", answer))
    return {"correct": bool(digits and digits.group(0) == passkey), "answer": answer.strip(),
            "prompt_tokens": int(inputs["input_ids"].shape[1])}


def passkey_accuracy(model: nn.Module, tokenizer, context_lengths=(256, 512, 1024), depths=(0.1, 0.5, 0.9),
                     trials: int = 2, digits: int = 5, seed: int = 0, max_new_tokens: int = 8,
                     progress: bool = False, keys: int = 1) -> dict:
    """Accuracy over ``context_lengths`` × ``depths`` × ``trials`` random ``digits``-digit pass keys
    (``keys > 1``: the multi-key variant, see the module docstring)."""
    from tqdm.auto import tqdm

    if trials < 1 or digits < 1:
        raise ValueError(f"trials and digits must be >= 1; got {trials}, {digits}")
    if not 1 <= keys <= len(LABELS):
        raise ValueError(f"keys must lie in 1..{len(LABELS)}, got {keys}")
    rng = random.Random(seed)
    records = []
    cases = [(length, depth) for length in context_lengths for depth in depths for _ in range(trials)]
    for length, depth in tqdm(cases, desc="passkey" if keys == 1 else f"passkey x{keys}", unit="trial",
                              disable=not progress):
        passkey = str(rng.randrange(10 ** (digits - 1), 10**digits))
        text, extra = None, {}
        if keys > 1:
            labels = rng.sample(LABELS, keys)
            others = [(label, str(rng.randrange(10 ** (digits - 1), 10**digits)), rng.random()) for label in labels[1:]]
            text = multikey_prompt(tokenizer, length, [(labels[0], passkey, depth), *others], labels[0])
            extra = {"asked": labels[0], "distractors": [key for _, key, _ in others]}
        result = passkey_trial(model, tokenizer, length, depth, passkey, max_new_tokens, text=text)
        records.append({"context": length, "depth": depth, "passkey": passkey, **extra, **result})

    def mean(rows) -> float:
        return sum(r["correct"] for r in rows) / len(rows)

    return {
        "accuracy": mean(records),
        "by_context": {str(n): mean([r for r in records if r["context"] == n]) for n in context_lengths},
        "by_depth": {str(d): mean([r for r in records if r["depth"] == d]) for d in depths},
        "by_context_depth": {f"{n}@{d}": mean([r for r in records if r["context"] == n and r["depth"] == d])
                             for n in context_lengths for d in depths},
        "settings": {"context_lengths": list(context_lengths), "depths": list(depths), "trials": trials,
                     "digits": digits, "seed": seed, "keys": keys},
        "trials": records,
    }


class RetrievalProbe(NamedTuple):
    """One teacher-forced probe: ``ids`` ``[1, L]``; the answer is ``ids[0, answer_start:]``; the needle sentence
    is ``ids[0, needle_start:needle_end]``."""

    ids: torch.Tensor
    answer_start: int
    needle_start: int
    needle_end: int


def retrieval_probes(tokenizer, haystack: torch.Tensor, count: int, context_tokens: int, digits: int = 5,
                     seed: int = 1234) -> list[RetrievalProbe]:
    """``count`` teacher-forced retrieval probes whose haystack is real text, not the evaluation's filler.

    ``haystack`` ``[N]``: token ids of a training corpus. Probe ``i``: a window of the haystack with the
    needle inserted at a random depth, then ``QUESTION`` and the answer (``RetrievalProbe``). Keys, depths and
    windows come from ``seed``, so the probes never repeat an evaluation prompt (whose filler is ``FILLER``).
    """
    rng = random.Random(seed)
    encode = lambda text: torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
    probes = []
    for _ in range(count):
        passkey = str(rng.randrange(10 ** (digits - 1), 10**digits))
        needle, question, answer = encode(" " + _needle(passkey)), encode(" " + QUESTION), encode(" " + passkey + ".")
        room = context_tokens - needle.numel() - question.numel() - answer.numel()
        if room < 1 or haystack.numel() < room:
            raise ValueError(f"a {context_tokens}-token probe needs {max(room, 1)} haystack tokens; "
                             f"{haystack.numel()} given")
        start = rng.randrange(0, haystack.numel() - room + 1)
        cut = rng.randrange(0, room + 1)
        text = haystack[start:start + room]
        ids = torch.cat([text[:cut], needle, text[cut:], question, answer])
        probes.append(RetrievalProbe(ids[None], int(ids.numel() - answer.numel()), cut, cut + needle.numel()))
    return probes
