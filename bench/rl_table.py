"""The table of ``make rl``: each RL run's held-out accuracy before training (its ``validate``) and at each validation
of its ``fit``, read back from the runs' own TensorBoard logs; then the RL step's measurements over each run (means
of the logged values; peak memory: the largest).

    python bench/rl_table.py runs/rl grpo_tiny wd1_tiny grpo_ar_tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lit_dllm.core.trace import run_scalars

TAG = "val/accuracy"
MEASURED = {"tied groups": "train/tied_groups", "tied updated": "train/update_tied_groups",
            "distinct / group": "train/distinct_completions", "solved groups (pass@G)": "train/solved_groups",
            "corr. with exact": "train/exact_correlation", "key log-ratio rms": "train/key_logratio_rms",
            "clip fraction": "train/clip_fraction", "reward": "train/reward"}
PEAKS = ("train/peak_gib_rollout", "train/peak_gib_old_policy", "train/peak_gib_update")


def accuracies(run: Path) -> list[tuple[int, float]]:
    """``(step, accuracy)`` of every validation in the run's version folders, oldest version first."""
    versions = sorted(run.glob("version_*"), key=lambda path: int(path.name.split("_")[1]))
    found = []
    for version in versions:
        steps, values = run_scalars(str(version)).get(TAG, ([], []))
        found += list(zip(steps, values))
    return found


def scalars(run: Path) -> dict[str, list[float]]:
    """Every logged value of each tag over the run's version folders."""
    found: dict[str, list[float]] = {}
    for version in run.glob("version_*"):
        for tag, (_, values) in run_scalars(str(version)).items():
            found.setdefault(tag, []).extend(values)
    return found


def measurements(root: Path, runs: list[str]) -> None:
    print("\n| run | " + " | ".join(MEASURED) + " | peak GiB rollout / old-policy / update |")
    print("|---|" + "---|" * (len(MEASURED) + 1))
    for name in runs:
        found = scalars(root / name)
        means = [f"{sum(v) / len(v):.3f}" if (v := found.get(tag)) else "" for tag in MEASURED.values()]
        peaks = " / ".join(f"{max(found[tag]):.2f}" if tag in found else "-" for tag in PEAKS)
        print(f"| {name} | " + " | ".join(means) + f" | {peaks} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    print(f"| run | held-out {TAG} before | after | change | at each validation (logged step: accuracy) |")
    print("|---|---|---|---|---|")
    for name in args.runs:
        found = accuracies(Path(args.root) / name)
        if not found:
            print(f"| {name} | (no {TAG} logged) | | | |")
            continue
        (_, before), (_, after) = found[0], found[-1]
        curve = ", ".join(f"{step}: {100 * value:.1f}" for step, value in found)
        print(f"| {name} | {100 * before:.1f} % | {100 * after:.1f} % | {100 * (after - before):+.1f} | {curve} |")
    measurements(Path(args.root), args.runs)


if __name__ == "__main__":
    main()
