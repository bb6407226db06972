"""The RL step of a dLLM with each sampler: rollout speed and reward, and where a step's time goes.

Trains the RL config (default: ``configs/grpo_smollm2_arith.yaml``, which starts from its SFT export) for
``--batches`` batches of rollouts once per sampler (LLaDA's, then the fast one), each from the same start, and prints a
markdown table: rollout tokens/s (completion tokens before eos, and the whole canvas) with the rollouts' mean reward
and accuracy, then each step's median seconds split into rollout, old-policy pass (``clipped`` only) and update
(``inner_updates`` forwards and backwards and optimizer steps), and the update's model FLOPs utilisation (6 per
trained matmul parameter and token, plus attention: :func:`lit_dllm.throughput.transformer_flops`). The first
``--warmup`` batches of each run are not counted. Every part is timed between CUDA synchronisations.

    python bench/bench_rl.py --config configs/grpo_smollm2_arith.yaml --batches 12 [train.py arguments]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import _common  # noqa: F401  (puts the checkout on sys.path)
import lightning as L
import torch

from lit_dllm.cli import main
from lit_dllm.throughput import peak_flops, transformer_flops


class StepSplit(L.Callback):
    """Times each training step and, inside it, the module's ``rollout`` and ``policy_logps`` calls."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.rollouts: list = []

    def _sync(self, module) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def _timed(self, module, name: str):
        call = getattr(module, name)

        def timed(*args, **kwargs):
            self._sync(module)
            start = time.perf_counter()
            result = call(*args, **kwargs)
            self._sync(module)
            self.steps[-1][name] += time.perf_counter() - start
            if name == "rollout":
                self.rollouts.append(result)
            return result

        setattr(module, name, timed)

    def on_fit_start(self, trainer, module) -> None:
        self.device = module.device  # the fit's (Lightning moves the module back to the CPU at its end)
        self._timed(module, "rollout")
        self._timed(module, "policy_logps")

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._sync(module)
        self.steps.append(defaultdict(float, start=time.perf_counter()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._sync(module)
        step = self.steps[-1]
        step["step"] = time.perf_counter() - step["start"]
        step["update"] = step["step"] - step["rollout"] - step["policy_logps"]
        rollouts = self.rollouts[-1]
        step["flops"] = module.rl.inner_updates * transformer_flops(module.model, module.model.hf.config,
                                                                    *rollouts.ids.shape)
        step["canvas"] = rollouts.targets.numel()
        step["completion"] = float(rollouts.scored.sum() - len(rollouts.rewards))  # before each eos
        step["reward"] = rollouts.rewards.mean().item()
        step["accuracy"] = module.accuracy(rollouts).item()


def run(config: str, sampler: str, batches: int, overrides: list[str]) -> tuple[StepSplit, torch.device, str]:
    cli = main(["--config", config, *overrides, f"--model.init_args.generation.sampler={sampler}",
                "--trainer.limit_val_batches=0", "--trainer.logger=false",
                "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
                "--trainer.enable_progress_bar=false", "--trainer.default_root_dir=/tmp/bench_rl"], run=False)
    split = StepSplit()
    cli.trainer.callbacks.append(split)
    cli.trainer.fit_loop.epoch_loop.max_steps = batches * cli.model.rl.inner_updates
    cli.trainer.fit(cli.model, cli.datamodule)
    return split, split.device, cli.trainer.precision


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo_smollm2_arith.yaml")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args, overrides = parser.parse_known_args()  # the others: train.py arguments for both runs
    print("| sampler | rollout tokens/s (completion) | canvas tokens/s | reward | accuracy | step s | rollout s "
          "| old-policy s | update s | update MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for sampler in ("llada", "fast"):
        split, device, precision = run(args.config, sampler, args.batches, overrides)
        steps = split.steps[args.warmup:]
        rollout = sum(s["rollout"] for s in steps)

        def median(key: str) -> float:
            return statistics.median(s[key] for s in steps)

        peak = peak_flops(device, precision)
        mfu = f"{100 * median('flops') / median('update') / peak:.1f} %" if peak else "n/a"
        print(f"| {sampler} | {sum(s['completion'] for s in steps) / rollout:,.0f} "
              f"| {sum(s['canvas'] for s in steps) / rollout:,.0f} | {statistics.mean(s['reward'] for s in steps):.3f} "
              f"| {statistics.mean(s['accuracy'] for s in steps):.3f} | {median('step'):.3f} | {median('rollout'):.3f} "
              f"| {median('policy_logps'):.3f} | {median('update'):.3f} | {mfu} |", flush=True)


if __name__ == "__main__":
    main_()
