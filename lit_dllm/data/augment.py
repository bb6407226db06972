"""More prompts from the prompts you have: numeric variants of word problems, for target regeneration.

A DFlash draft learns its target's answers; with few prompts it memorises them (docs/BENCHMARKS.md: 1,100 GSM8K
questions overfit a 5-layer draft in a few epochs). Each variant here is a source question with every number
replaced by another of the same shape (digits, thousands separators, decimals), so the target answers a new
problem in the same style. The variants' old answers no longer fit; regeneration replaces them
(``configs/smollm2_regenerate_gsm8k.yaml``). Only training rows should be varied: held-out questions stay unseen.

    python -m lit_dllm.data.augment runs/data/gsm8k/train.jsonl runs/data/gsm8k_varied/train.jsonl \\
        --field question --variants 8
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\w])")


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


def vary_rows(rows: list[dict], field: str, variants: int, seed: int = 0) -> tuple[list[dict], int]:
    """``variants`` copies of each row with ``field`` varied by :func:`vary_numbers`, each tagged with
    ``source_index`` (its row) and ``variant``, variant by variant (all rows' first variants, then the second ...:
    a regeneration cut short still covers every row); the same ``seed`` gives the same rows. Rows whose field has
    no number cannot vary: they are left out and counted (the second value)."""
    if variants < 1:
        raise ValueError(f"variants={variants}: ask for at least 1 variant per row.")
    for index, row in enumerate(rows):
        if not isinstance(row.get(field), str):
            raise ValueError(f"Row {index} has no text field {field!r} (fields: {sorted(row)}): name the prompt "
                             "field with --field.")
    numbered = [(index, row) for index, row in enumerate(rows) if NUMBER.search(row[field])]
    varied = [{**row, field: vary_numbers(row[field], random.Random(f"{seed}:{index}:{variant}")),
               "source_index": index, "variant": variant}
              for variant in range(variants) for index, row in numbered]
    return varied, len(rows) - len(numbered)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a jsonl file of rows")
    parser.add_argument("out", type=Path, help="the jsonl file to write (refused if it exists)")
    parser.add_argument("--field", default="question", help="the prompt field to vary")
    parser.add_argument("--variants", type=int, default=8, help="variants per source row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: delete it or choose another path (variants are not appended).")
    lines = args.source.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    varied, without_numbers = vary_rows(rows, args.field, args.variants, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in varied), encoding="utf-8")
    print(f"{args.out}: {len(varied)} rows ({args.variants} variants of {len(rows) - without_numbers} rows); "
          f"{without_numbers} rows without a number in {args.field!r} left out")


if __name__ == "__main__":
    main()
