"""The RL step of a dLLM with each log-probability estimator: where a step's time and memory go.

Trains the RL config (default: ``configs/grpo_smollm2_arith.yaml``, which starts from its SFT export) for
``--batches`` batches of rollouts once per estimator, each from the same start: d1's one pass and the ELBO (2 coupled
samples) on block-wise fast rollouts (blocks of 32), the exact estimator on left-to-right ones (blocks of one token).
Prints a markdown table from the phases the RL step itself measures (:class:`lit_dllm.rl.step.PhaseMeter`, each
between CUDA synchronisations): the median seconds of the rollout, the old-policy scoring pass (``clipped``), the
updates (``inner_updates`` forwards, backwards and optimizer steps) and the measurements, the scoring pass's cost
per completion and pass, the peak allocated memory of each phase and the rollouts' mean reward. The first ``--warmup`` batches
of each run are not counted.

    python bench/bench_rl.py --config configs/grpo_smollm2_arith.yaml --batches 12 [--estimators exact] \
        [train.py arguments]
"""

from __future__ import annotations

import argparse
import statistics

import _common  # noqa: F401  (puts the checkout on sys.path)
import lightning as L

from lit_dllm.cli import main

BLOCKWISE = ["--model.init_args.generation.gen_block_length=32", "--model.init_args.generation.gen_steps=64"]
ESTIMATORS = {
    "one_pass": ["--model.init_args.rl.estimator=one_pass", *BLOCKWISE],
    "elbo (2 coupled)": ["--model.init_args.rl.estimator=elbo", "--model.init_args.rl.mc_samples=2", *BLOCKWISE],
    "exact": ["--model.init_args.rl.estimator=exact", "--model.init_args.generation.gen_block_length=1"],
}
PHASES = ("rollout", "old_policy", "update", "measure")


class Phases(L.Callback):
    """Each step's phase seconds and peak memory, as the RL step logged them."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.steps.append({name[len("train/"):]: float(value) for name, value in metrics.items()
                           if name.startswith(("train/seconds_", "train/peak_gib_", "train/reward"))})
        passes = 1 if module.estimator == "exact" else module.rl.inner_updates  # the old-policy passes it made
        groups = module.rl.update_groups or len(batch["prompt_ids"])  # dynamic sampling scores the kept groups only
        self.steps[-1]["completions"] = groups * module.rl.group_size * passes


def run(config: str, batches: int, overrides: list[str]) -> Phases:
    cli = main(["--config", config, *overrides, "--trainer.limit_val_batches=0", "--trainer.logger=false",
                "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
                "--trainer.enable_progress_bar=false", "--trainer.default_root_dir=/tmp/bench_rl"], run=False)
    phases = Phases()
    cli.trainer.callbacks.append(phases)
    cli.trainer.fit_loop.epoch_loop.max_steps = batches * cli.model.rl.inner_updates
    cli.trainer.fit(cli.model, cli.datamodule)
    return phases


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo_smollm2_arith.yaml")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=list(ESTIMATORS),
                        help="the rows to run (default: all)")
    args, overrides = parser.parse_known_args()  # the others: train.py arguments for every run
    print("| estimator | rollout s | old-policy s | update s | measure s | scoring ms / completion / pass "
          "| peak GiB rollout / old-policy / update | reward |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.estimators:
        steps = run(args.config, args.batches, [*overrides, *ESTIMATORS[name]]).steps[args.warmup:]

        def median(key: str) -> float:
            return statistics.median(s.get(key, 0.0) for s in steps)

        per_completion = 1000 * median("seconds_old_policy") / median("completions")
        peaks = " / ".join(f"{median(f'peak_gib_{phase}'):.2f}" for phase in PHASES[:3])
        print(f"| {name} | " + " | ".join(f"{median(f'seconds_{phase}'):.3f}" for phase in PHASES)
              + f" | {per_completion:.2f} | {peaks} | {statistics.mean(s['reward'] for s in steps):.3f} |", flush=True)


if __name__ == "__main__":
    main_()
