"""Real acceptance length τ of a trained DFlash draft on held-out prompts, decoded by many processes at once.

transformers' speculative decoding (``target.generate(assistant_model=draft, speculation_type="dflash")``) takes one
prompt at a time and is bound by Python and kernel launches, not by the GPU: a 135 M target decodes ~50 tokens/s.
This script tokenises the validation prompts of ``--config`` once and splits them over ``--procs`` processes spread
over the visible GPUs (round robin; ``--seconds``: stopped then, the prompts decoded so far reported), each running
the module's own
:meth:`~lit_dllm.families.dflash.module.DFlashModule.target_generate` and
:meth:`~lit_dllm.families.dflash.module.DFlashModule.speculative_decode` — what validation runs — and prints one
markdown row per checkpoint: τ greedy and at ``--temperature`` (tokens committed per target verification, pooled over
all steps, as ``val/accept_len``), greedy identical to the target alone, exact match of the greedy answers, wall time
(each prompt's decodes are :meth:`~lit_dllm.families.dflash.module.DFlashModule.score_prompt`, validation's own).

    python bench/dflash_tau.py --config configs/dflash_smollm2_gsm8k.yaml --procs 32 \\
        runs/dflash_smollm2_gsm8k/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import yaml


def prompts_of(config: str, limit: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt, reference answer) token pairs of the config's validation split, in order."""
    from lit_dllm import DLLMDataModule
    from lit_dllm.data.batch import split_prompt_answer

    data = DLLMDataModule(**yaml.safe_load(open(config))["data"]["init_args"])
    data.prepare_data()
    data.setup("validate")
    pairs = []
    for batch in data.val_dataloader():
        _, prompts, answers = split_prompt_answer(batch)
        pairs += zip(prompts, answers)
    return pairs[:limit]


def decode_shard(args: argparse.Namespace) -> None:
    """Worker: decode every ``procs``-th prompt from ``shard`` on, one JSON line per prompt."""
    from lit_dllm.eval.harness import load_module

    torch.set_num_threads(1)
    module = load_module(args.ckpt, device="cuda" if torch.cuda.is_available() else "cpu").eval()
    if args.float32:
        module.float()
    eos = module.hparams.eos_token_id
    with open(args.out, "w") as out:
        for index, (prompt, answer) in enumerate(torch.load(args.prompts)):
            if index % args.procs != args.shard:
                continue
            start = time.perf_counter()
            scored = module.score_prompt(prompt, answer[answer != eos], args.gen_length, args.temperature)
            out.write(json.dumps({"index": index, **scored._asdict(), "seconds": time.perf_counter() - start}) + "\n")
            out.flush()


def pooled(rows: list[dict], key: str) -> float:
    steps = [n for row in rows for n in row[key]]
    return sum(steps) / max(len(steps), 1)


def wait_until(workers: list[subprocess.Popen], deadline: float | None) -> list[subprocess.Popen]:
    """Wait for the workers until ``deadline`` (``time.perf_counter``; None: their end); stop those still running
    then and return them."""
    for worker in workers:
        try:
            worker.wait(None if deadline is None else max(deadline - time.perf_counter(), 0))
        except subprocess.TimeoutExpired:
            break
    stopped = [worker for worker in workers if worker.poll() is None]
    for worker in stopped:
        worker.terminate()
        worker.wait()
    return stopped


def run_checkpoint(args: argparse.Namespace, ckpt: str, prompts: list) -> None:
    gpus = torch.cuda.device_count()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        torch.save(prompts, f"{folder}/prompts.pt")
        workers = []
        for shard in range(args.procs):
            env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(shard % gpus)} if gpus else {}))
            command = [sys.executable, __file__, "--worker", "--shard", str(shard), "--out", f"{folder}/{shard}.jsonl",
                       "--prompts", f"{folder}/prompts.pt", "--ckpt", ckpt, *args.passed]
            workers.append(subprocess.Popen(command, env=env))
        stopped = wait_until(workers, start + args.seconds if args.seconds else None)
        if any(worker.returncode for worker in workers if worker not in stopped):
            sys.exit(f"a worker failed on {ckpt}")
        outputs = [f"{folder}/{shard}.jsonl" for shard in range(args.procs)]
        rows = [json.loads(line) for path in outputs if os.path.exists(path) for line in open(path)
                if line.endswith("\n")]  # a stopped worker may not have begun its file, or cut its last line
    wall = time.perf_counter() - start
    if stopped:
        ckpt += f" (stopped after {args.seconds:.0f} s: the prompts decoded by then)"
        if not rows:
            sys.exit(f"no prompt of {ckpt} was decoded")
    sampled = f"{pooled(rows, 'sampled'):.2f}" if args.temperature else "-"
    count = f"{len(rows)} of {len(prompts)}" if stopped else len(rows)
    print(f"| {ckpt} | {count} | {pooled(rows, 'greedy'):.2f} | {sampled} | "
          f"{sum(r['identical'] for r in rows) / len(rows):.3f} | {sum(r['exact'] for r in rows) / len(rows):.3f} | "
          f"{wall:.0f} | {sum(r['seconds'] for r in rows) / len(rows):.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpts", nargs="*", help="DFlash checkpoints (one table row each)")
    parser.add_argument("--config", default="configs/dflash_smollm2_gsm8k.yaml", help="its data section gives the prompts")
    parser.add_argument("--procs", type=int, default=8, help="decoding processes (spread over the visible GPUs)")
    parser.add_argument("--limit", type=int, help="the first N validation prompts only")
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0, help="a sampled decode besides greedy (0: none)")
    parser.add_argument("--seconds", type=float, help="stop each checkpoint's decoding after this long and report the "
                        "prompts decoded by then (a time-limited call still prints its row)")
    parser.add_argument("--float32", action="store_true",
                        help="target and draft in float32 (bf16 near-ties flip greedy argmaxes: the identity check)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return decode_shard(args)
    args.passed = ["--procs", str(args.procs), "--gen-length", str(args.gen_length), "--temperature",
                   str(args.temperature), *(["--float32"] if args.float32 else [])]
    print(f"| checkpoint | prompts | τ greedy | τ T={args.temperature} | greedy identical | exact match | wall s | "
          "s / prompt |")
    print("|---|---|---|---|---|---|---|---|")
    prompts = prompts_of(args.config, args.limit)  # tokenised once, not by every worker
    for ckpt in args.ckpts:
        run_checkpoint(args, ckpt, prompts)


if __name__ == "__main__":
    main()
