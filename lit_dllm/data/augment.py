"""More prompts from the prompts you have, for target regeneration: numeric variants, and new questions that the
target writes itself from few-shot prompts.

A DFlash draft learns its target's answers; with few prompts it memorises them (docs/benchmarks/real_model.md: 1,100
GSM8K questions overfit a 5-layer draft in a few epochs). Two ways to more prompts, both from training rows only (held-out
questions stay unseen):

* ``vary``: each variant is a source question with every number replaced by another of the same shape (digits,
  thousands separators, decimals), so the target answers a new problem in the same style.
* ``few-shot`` then ``harvest``: prompts of a few random training questions (``Question: ...`` blocks, ending in an
  open ``Question:``) that the target continues as plain text (``use_chat_template: false``, sampled): each
  continuation's first block is a new question in the same style, written by the model the draft must serve.
  ``harvest`` keeps the new questions that look like word problems (a number, a question mark, 40-600 characters),
  once each, none equal to a question of the files named with ``--exclude`` (the training and held-out questions).

The answers that come with the new rows no longer fit (or are placeholders); regeneration replaces them
(``configs/smollm2_regenerate_gsm8k.yaml``).

    python -m lit_dllm.data.augment vary runs/data/gsm8k/train.jsonl runs/data/gsm8k_varied/train.jsonl --variants 8
    python -m lit_dllm.data.augment few-shot runs/data/gsm8k/train.jsonl runs/data/gsm8k_new/prompts.jsonl --count 40000
    python train.py predict --config configs/smollm2_regenerate_gsm8k.yaml --data.init_args.formatting.use_chat_template=false \\
        --data.init_args.source.path=runs/data/gsm8k_new/prompts.jsonl --model.init_args.generation.temperature=1.0 \\
        --model.init_args.generation.gen_length=96 \\
        --trainer.callbacks.init_args.path=runs/data/gsm8k_new/continued.jsonl
    python -m lit_dllm.data.augment harvest runs/data/gsm8k_new/continued.jsonl runs/data/gsm8k_new/questions.jsonl \\
        --exclude runs/data/gsm8k/train.jsonl runs/data/gsm8k/validation.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\w])")
SHOT = "Question: {}\n\n"  # one few-shot block; a prompt ends with an open "Question:"
QUESTION_CHARS = (40, 600)  # the length of a harvested question
UNANSWERED = "(to be answered by the target)"  # the response of a new row: regeneration replaces it


def _another_number(match: re.Match, rng: random.Random) -> str:
    whole, decimals = match.group(1), match.group(2) or ""
    digits = len(whole.replace(",", ""))
    low = 2 if digits == 1 else 10 ** (digits - 1)  # 0 and 1 change the grammar ("1 apples")
    value = rng.randint(low, 10**digits - 1)
    text = f"{value:,}" if "," in whole else str(value)
    if decimals:
        text += "." + "".join(str(rng.randint(0, 9)) for _ in decimals[1:])
    return text


def vary_numbers(text: str, rng: random.Random) -> str:
    """``text`` with every number replaced by a random one with as many digits (2-9 for one digit), the same
    thousands separators and as many decimals. Words, units and punctuation are kept."""
    return NUMBER.sub(lambda match: _another_number(match, rng), text)


def _check_field(rows: list[dict], field: str) -> None:
    for index, row in enumerate(rows):
        if not isinstance(row.get(field), str):
            raise ValueError(f"Row {index} has no text field {field!r} (fields: {sorted(row)}): name the prompt "
                             "field with --field.")


def vary_rows(rows: list[dict], field: str, variants: int, seed: int = 0) -> tuple[list[dict], int]:
    """``variants`` copies of each row with ``field`` varied by :func:`vary_numbers`, each tagged with
    ``source_index`` (its row) and ``variant``, variant by variant (all rows' first variants, then the second ...:
    a regeneration cut short still covers every row); the same ``seed`` gives the same rows. Rows whose field has
    no number cannot vary: they are left out and counted (the second value)."""
    if variants < 1:
        raise ValueError(f"variants={variants}: ask for at least 1 variant per row.")
    _check_field(rows, field)
    numbered = [(index, row) for index, row in enumerate(rows) if NUMBER.search(row[field])]
    varied = [{**row, field: vary_numbers(row[field], random.Random(f"{seed}:{index}:{variant}")),
               "source_index": index, "variant": variant}
              for variant in range(variants) for index, row in numbered]
    return varied, len(rows) - len(numbered)


def few_shot_prompts(rows: list[dict], field: str, shots: int, count: int, seed: int = 0,
                     response_field: str = "answer") -> list[dict]:
    """``count`` rows whose ``field`` is ``shots`` distinct random questions of ``rows`` as ``Question: ...`` blocks
    followed by an open ``Question:`` (``response_field``: :data:`UNANSWERED`, for the continuation); the same ``seed`` gives
    the same prompts."""
    if not 1 <= shots <= len(rows):
        raise ValueError(f"shots={shots}: choose between 1 and the {len(rows)} source rows.")
    if count < 1:
        raise ValueError(f"count={count}: ask for at least 1 prompt.")
    _check_field(rows, field)
    prompts = []
    for index in range(count):
        chosen = random.Random(f"{seed}:{index}").sample(range(len(rows)), shots)
        text = "".join(SHOT.format(rows[row][field].strip()) for row in chosen) + "Question:"
        prompts.append({field: text, response_field: UNANSWERED, "shots": chosen})
    return prompts


def first_question(continuation: str) -> str | None:
    """The question a few-shot continuation starts with: its text up to the first blank line or next ``Question:``,
    on one line; None unless it looks like a word problem (a number, ends with ``?``, 40-600 characters)."""
    text = re.split(r"\n\s*\n|Question:", continuation, maxsplit=1)[0]
    text = " ".join(text.split())
    low, high = QUESTION_CHARS
    if low <= len(text) <= high and text.endswith("?") and NUMBER.search(text):
        return text
    return None


def harvest_questions(rows: list[dict], field: str, response_field: str, exclude: set[str]) -> tuple[list[dict], dict]:
    """One row (``field``: the new question, ``response_field``: :data:`UNANSWERED`) per continuation of ``rows`` whose
    :func:`first_question` is new: not in ``exclude`` (compared on whitespace-normalised text) nor harvested
    before. The second value counts the continuations kept and dropped, by reason."""
    _check_field(rows, response_field)
    seen = {" ".join(question.split()) for question in exclude}
    kept, counts = [], {"kept": 0, "not a question": 0, "repeated": 0}
    for row in rows:
        question = first_question(row[response_field])
        reason = "not a question" if question is None else "repeated" if question in seen else "kept"
        counts[reason] += 1
        if reason == "kept":
            seen.add(question)
            kept.append({field: question, response_field: UNANSWERED})
    return kept, counts


def _read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``: never a partial file."""
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in [("vary", "numeric variants of each source row"),
                       ("few-shot", "few-shot prompts for new questions, for the target to continue"),
                       ("harvest", "the new questions in the target's continuations of few-shot prompts")]:
        command = commands.add_parser(name, help=text)
        command.add_argument("source", type=Path, help="a jsonl file of rows")
        command.add_argument("out", type=Path, help="the jsonl file to write (refused if it exists, unless "
                             "--overwrite)")
        command.add_argument("--overwrite", action="store_true", help="replace the file out if it exists")
        command.add_argument("--field", default="question", help="the prompt field")
        command.add_argument("--seed", type=int, default=0)
        if name != "vary":
            command.add_argument("--response-field", default="answer", help="the response (continuation) field")
    commands.choices["vary"].add_argument("--variants", type=int, default=8, help="variants per source row")
    commands.choices["few-shot"].add_argument("--shots", type=int, default=4, help="questions per prompt")
    commands.choices["few-shot"].add_argument("--count", type=int, required=True, help="prompts to write")
    commands.choices["harvest"].add_argument("--exclude", type=Path, nargs="*", default=[],
                                             help="jsonl files whose questions are not new (training, held-out)")
    args = parser.parse_args(argv)
    if args.out.exists() and not (args.overwrite and args.out.is_file()):  # usage errors: exit status 2
        parser.error(f"{args.out} exists: choose another path, delete it, or pass --overwrite to replace it "
                     "(rows are not appended)." if args.out.is_file() else f"{args.out} exists and is not a "
                     "file: choose another path.")
    for path in [args.source, *getattr(args, "exclude", [])]:
        if not path.is_file():
            parser.error(f"No file {path}: name an existing jsonl file (GSM8K's splits come from `make gsm8k`).")
    rows = _read_rows(args.source)
    if args.command == "vary":
        out, without_numbers = vary_rows(rows, args.field, args.variants, args.seed)
        summary = (f"{args.variants} variants of {len(rows) - without_numbers} rows; {without_numbers} rows without "
                   f"a number in {args.field!r} left out")
    elif args.command == "few-shot":
        out = few_shot_prompts(rows, args.field, args.shots, args.count, args.seed, args.response_field)
        summary = f"{args.shots} of {len(rows)} questions each"
    else:
        exclude = {row[args.field] for path in args.exclude for row in _read_rows(path) if args.field in row}
        out, counts = harvest_questions(rows, args.field, args.response_field, exclude)
        summary = ", ".join(f"{value} {reason}" for reason, value in counts.items()) + f" of {len(rows)} continuations"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(args.out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in out))
    print(f"{args.out}: {len(out)} rows ({summary})")


if __name__ == "__main__":
    main()
