"""The real-model recipes (configs/*_smollm2_gsm8k.yaml and the regeneration) run as written, in order, on a tiny
stand-in: a 2-layer Llama with the embedded tokenizer (plus an unused special token, as SmolLM2 has) at the model
folder's path, and a few GSM8K-shaped rows at the data paths. Only the trainer is shrunk (2 steps on the CPU)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lit_dllm.cli import main
from lit_dllm.data.tokenizer import build_default_tokenizer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODEL = "runs/models/smollm2-135m-instruct"
SMALL = ["--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.enable_progress_bar=false"]
FIT = [*SMALL, "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
       "--data.init_args.loader.batch_size=2", "--data.init_args.loader.val_batch_size=2", "--model.init_args.generation.gen_length=32"]


def gsm8k_rows(count: int, start: int = 0) -> str:
    rows = [{"question": f"Tom has {n} apples and buys 2 more. How many?", "answer": f"{n} + 2 = {n + 2}\n#### {n + 2}"}
            for n in range(start, start + count)]
    return "".join(json.dumps(row) + "\n" for row in rows)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """``tmp_path`` as the working directory, holding the stand-in model folder and `make gsm8k`'s files."""
    tokenizer = build_default_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<filename>"]}, replace_extra_special_tokens=False)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / MODEL)  # bf16, as make real-model
    tokenizer.save_pretrained(tmp_path / MODEL)
    for folder in ("gsm8k", "gsm8k_smollm2"):
        (tmp_path / "runs/data" / folder).mkdir(parents=True)
        (tmp_path / "runs/data" / folder / "validation.jsonl").write_text(gsm8k_rows(3, start=100))
    (tmp_path / "runs/data/gsm8k/train.jsonl").write_text(gsm8k_rows(6))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_recipes_run_as_written_on_a_stand_in(stand_in):
    cli = main(["validate", "--config", str(CONFIGS / "ar_smollm2_gsm8k.yaml"), *SMALL, "--trainer.limit_val_batches=1",
                "--model.init_args.generation.gen_length=8"])  # the pretrained baseline: no checkpoint needed
    assert cli.trainer.callback_metrics["val/exact_match"] >= 0

    main(["predict", "--config", str(CONFIGS / "smollm2_regenerate_gsm8k.yaml"), *SMALL,
          "--model.init_args.generation.gen_length=8"])
    regenerated = [json.loads(line) for line in (stand_in / "runs/data/gsm8k_smollm2/train.jsonl").read_text().splitlines()]
    assert sorted(row["question"] for row in regenerated) == sorted(
        json.loads(line)["question"] for line in gsm8k_rows(6).splitlines())

    for family in ("ar", "mdlm", "hybrid", "dflash"):
        cli = main(["fit", "--config", str(CONFIGS / f"{family}_smollm2_gsm8k.yaml"), *FIT])
        assert cli.trainer.global_step == 2, family
        assert torch.isfinite(cli.trainer.callback_metrics["train/loss"]), family
        if family in ("mdlm", "hybrid"):  # <|mask|> was added: the embeddings grew to a multiple of 64
            assert cli.model.model.hf.get_input_embeddings().weight.shape[0] == 128
            assert cli.model.model.hf.get_output_embeddings().weight.shape[0] == 128
            assert cli.model.hparams.mask_token_id == cli.datamodule.tokenizer.convert_tokens_to_ids("<|mask|>")
        if family == "dflash":  # the noise token is one of the target's own ids
            assert cli.model.hparams.mask_token_id == cli.datamodule.tokenizer.convert_tokens_to_ids("<filename>")
            assert cli.trainer.callback_metrics["val/greedy_identical"] == 1.0


def test_a_dflash_mask_token_outside_the_target_names_the_tokens_to_use(stand_in):
    (stand_in / "runs/data/gsm8k_smollm2/train.jsonl").write_text(gsm8k_rows(6))
    with pytest.raises(ValueError, match=r"mask token '<\|mask\|>' \(id \d+\) was added.*unused: \[.*'<filename>'"):
        main(["fit", "--config", str(CONFIGS / "dflash_smollm2_gsm8k.yaml"), *FIT, "--data.init_args.tokenizer.mask_token=<|mask|>"])


SORT = ["--data.init_args.source.path=task:sort", '--data.init_args.task.kwargs={"min_len":10,"max_len":14}']


@pytest.mark.parametrize("rl_config, start, task, dynamic", [
    ("grpo_smollm2_arith.yaml", "mdlm_sft", [], ["--model.init_args.rl.update_groups=2"]),
    ("grpo_smollm2_sort.yaml", "mdlm_sort_sft", SORT, []),
])
def test_the_rl_recipes_run_as_written_from_their_sft_start(stand_in, rl_config, start, task, dynamic):
    """bench/rl_smollm2.sh's order: the MDLM SFT start on the config's task, exported where the RL config looks, then
    the RL config with its estimator, rollouts and dynamic sampling as written (the trainer, batch and canvas shrunk:
    6 prompts rolled out, 2 groups updated where the config samples dynamically)."""
    sft = main(["fit", "--config", str(CONFIGS / "mdlm_smollm2_arith.yaml"), *FIT, *task,
                "--data.init_args.task.num_train=8", "--data.init_args.task.num_val=2"])
    sft.model.save_pretrained(stand_in / "runs/rl_smollm2" / start / "hf")

    rl = main(["fit", "--config", str(CONFIGS / rl_config), *SMALL, "--trainer.max_steps=2",
               "--trainer.val_check_interval=1", "--data.init_args.loader.batch_size=6",
               "--data.init_args.loader.val_batch_size=2", "--data.init_args.task.num_val=2",
               "--model.init_args.generation.gen_length=8", *dynamic])
    metrics = rl.trainer.callback_metrics
    assert (rl.model.estimator, rl.model.generation.gen_block_length) == ("exact", 1)
    assert rl.trainer.global_step == 2
    assert torch.isfinite(metrics["train/loss"])
    # on-policy by construction: the exact estimate of each committed token is the probability the sampler drew it with
    assert metrics["train/rollout_logp_gap"] < 1e-4
