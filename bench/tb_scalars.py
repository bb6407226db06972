"""Print a run's logged scalars over steps as a markdown table (the curves behind docs/BENCHMARKS.md's figures).

    python bench/tb_scalars.py runs/dflash_smollm2_gsm8k/version_0 val/accept_len val/accept_len_sampled
"""

from __future__ import annotations

import argparse

from lit_dllm.core.trace import run_scalars


def scalars(log_dir: str, tags: list[str]) -> dict[int, dict[str, float]]:
    """``{step: {tag: value}}`` for the ``tags`` a TensorBoard log folder holds (the last value at a step wins)."""
    logged = run_scalars(log_dir)
    table: dict[int, dict[str, float]] = {}
    for tag in (tag for tag in tags if tag in logged):
        for step, value in zip(*logged[tag]):
            table.setdefault(step, {})[tag] = value
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir")
    parser.add_argument("tags", nargs="+")
    args = parser.parse_args()
    table = scalars(args.log_dir, args.tags)
    print("| step | " + " | ".join(args.tags) + " |")
    print("|---|" + "---|" * len(args.tags))
    for step in sorted(table):
        print(f"| {step} | " + " | ".join(f"{table[step][t]:.4f}" if t in table[step] else "" for t in args.tags) + " |")


if __name__ == "__main__":
    main()
