"""Target-regenerated data: ``train.py predict`` of a pretrained causal LM with ``RegeneratedDataWriter`` writes each
prompt's source row with the model's own answer, resumes after an interruption, and reads back as data; evaluating
pretrained weights needs no ``--ckpt_path``, random-init weights still do."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_dllm.callbacks import RegeneratedDataWriter
from lit_dllm.cli import main
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.data.tokenizer import build_default_tokenizer
from lit_dllm.settings import BuiltinTask, DataSource, Formatting, Loader, Splits, Tokenizer
from lit_dllm.testing import TINY_LLAMA

from .test_cli import TINY_OVERRIDES

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "smollm2_regenerate_gsm8k.yaml")
MODEL, DATA = Path("runs/models/smollm2-135m-instruct"), Path("runs/data/gsm8k/train.jsonl")  # the config's paths
WRITTEN = Path("runs/data/gsm8k_smollm2/train.jsonl")
QUESTIONS = ["What is 2+3?", "Name a color.", "Count to 3.", "Is 7 prime?", "Spell cat.", "What is 10/2?"]
GEN_LENGTH = 12


def tiny_pretrained(folder: Path) -> None:
    """A random tiny Llama with the embedded tokenizer, saved like a hub model folder."""
    tokenizer = build_default_tokenizer(folder)
    config = AutoConfig.for_model(**dict(TINY_LLAMA, max_position_embeddings=1024), vocab_size=len(tokenizer),
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The regeneration config's model folder and GSM8K-like data (question / answer fields), in a fresh cwd."""
    monkeypatch.chdir(tmp_path)
    tiny_pretrained(MODEL)
    DATA.parent.mkdir(parents=True)
    rows = [{"question": question, "answer": f"Answer {i}."} for i, question in enumerate(QUESTIONS)]
    DATA.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return tmp_path


def regenerate(*extra: str):
    return main(["predict", "--config", CONFIG, "--trainer.accelerator=cpu", "--trainer.precision=32-true",
                 "--trainer.enable_progress_bar=false", f"--model.init_args.generation.gen_length={GEN_LENGTH}",
                 "--data.init_args.loader.val_batch_size=4", "--data.init_args.source.cache_dir=cache", *extra])


def own_answers(module, indices: list[int]) -> list[str]:
    """The module's own greedy answers to these questions, batched together, from the chat-templated prompts."""
    tokenizer = module.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i]}], tokenize=False,
                                           add_generation_prompt=True) for i in indices]
    prompts = [torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in module.generate_ids(prompts, GEN_LENGTH)]


def written_rows() -> list[dict]:
    return [json.loads(line) for line in WRITTEN.read_text().splitlines()]


def predicted_indices(cli) -> list[int]:
    return [row["example_index"] for batch in cli.trainer.predict_loop.predictions for row in batch]


def test_regeneration_writes_source_rows_with_own_answers_and_resumes(workdir, caplog):
    with caplog.at_level(logging.INFO):
        first = regenerate()
    assert "No --ckpt_path: scoring the pretrained weights of backbone.model runs/models/smollm2-135m-instruct" in caplog.text
    rows = written_rows()
    assert [row["example_index"] for row in rows] == list(range(len(QUESTIONS)))  # the whole file, in order
    assert [row["question"] for row in rows] == QUESTIONS  # the raw prompt, not the chat-templated one
    assert all(set(row) == {"question", "answer", "example_index"} for row in rows)
    expected = own_answers(first.model, [0, 1, 2, 3]) + own_answers(first.model, [4, 5])  # val_batch_size=4
    assert [row["answer"] for row in rows] == expected
    hit = sum(row["hit_gen_length"] for batch in first.trainer.predict_loop.predictions for row in batch)
    assert "wrote 6 rows now, 0 were already there: 6 rows for the 6 predict examples" in caplog.text
    assert (f"{hit} of the 6 new answers hit gen_length={GEN_LENGTH} without eos" in caplog.text) == (hit > 0)

    # an interruption: two rows never written, the last one cut mid-line
    lines = WRITTEN.read_text().splitlines(keepends=True)
    WRITTEN.write_text("".join(lines[i] for i in (0, 2, 3, 5)) + lines[1][:15])
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="incomplete last line"):
        resumed = regenerate()
    assert predicted_indices(resumed) == [1, 4]  # only the missing prompts were generated
    assert WRITTEN.read_text().splitlines(keepends=True)[:4] == [lines[i] for i in (0, 2, 3, 5)]  # kept as they were
    again = {row["example_index"]: row for row in written_rows()}
    assert len(again) == len(written_rows()) == 6
    assert [again[i]["answer"] for i in (1, 4)] == own_answers(resumed.model, [1, 4])
    assert all(again[i] == rows[i] for i in (0, 2, 3, 5))
    assert "wrote 2 rows now, 4 were already there: 6 rows for the 6 predict examples" in caplog.text

    complete = regenerate()  # nothing left to do
    assert predicted_indices(complete) == [] and len(written_rows()) == 6

    # the file is data again, with the same fields
    data = DLLMDataModule(DataSource(path=str(WRITTEN), prompt_field="question", response_field="answer",
                                     cache_dir="cache"),
                          Tokenizer(name=str(MODEL)), Formatting(use_chat_template=True), splits=Splits(test="train"),
                          max_seq_len=1024)
    examples = [data.source_row(i) for i in range(data.num_examples()[0])]
    kept = [row for row in written_rows() if row["answer"].strip()]  # an empty answer is dropped (logged)
    assert examples == [{"question": row["question"], "answer": row["answer"]} for row in kept]


def test_interrupted_predict_leaves_a_resumable_file(workdir):
    """limit_predict_batches stands in for an interruption: the missing rows are reported, then completed."""
    with pytest.warns(UserWarning, match="2 of the 6 predict examples have no row"):
        regenerate("--trainer.limit_predict_batches=1")
    assert [row["example_index"] for row in written_rows()] == [0, 1, 2, 3]
    resumed = regenerate()
    assert predicted_indices(resumed) == [4, 5]
    assert [row["example_index"] for row in written_rows()] == list(range(6))


def test_rows_of_other_data_are_refused(workdir):
    WRITTEN.parent.mkdir(parents=True)
    WRITTEN.write_text(json.dumps({"question": "Another question?", "answer": "x", "example_index": 0}) + "\n")
    with pytest.raises(ValueError, match="line 1 \\(example_index 0\\) does not match"):
        regenerate()


def test_several_processes_are_refused(workdir):
    data = DLLMDataModule(DataSource(path=str(DATA), prompt_field="question", response_field="answer",
                                     cache_dir="cache"), splits=Splits(test="train"))
    trainer = SimpleNamespace(datamodule=data, world_size=2)
    with pytest.raises(ValueError, match="set trainer.devices=1"):
        RegeneratedDataWriter(str(WRITTEN)).setup(trainer, None, "predict")


# ---------------------------------------------------------------------------- source rows of the data module


def test_chat_source_rows_get_their_last_assistant_turn_replaced(tmp_path):
    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}],
             [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],  # dropped: empty turn
             [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "fine"}]]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"turns": chat}) + "\n" for chat in chats))
    source = DataSource(path=str(path), messages_field="turns", cache_dir=str(tmp_path / "cache"))
    data = DLLMDataModule(source, formatting=Formatting(mask_history=True), splits=Splits(test="train"))
    assert data.num_examples("predict") == (2, 3)
    assert data.source_row(1) == {"turns": chats[2]}  # example 1 is row 2: row 1 was dropped
    replaced = data.replace_response(data.source_row(0), "later")
    assert replaced["turns"][:3] == chats[0][:3] and replaced["turns"][3] == {"role": "assistant", "content": "later"}
    multi = DLLMDataModule(source, splits=Splits(test="train"))
    with pytest.raises(ValueError, match="2 supervised assistant turns.*set data.init_args.formatting.mask_history"):
        multi.replace_response(multi.source_row(0), "later")


def test_text_has_no_source_rows(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(4)))
    data = DLLMDataModule(DataSource(path=str(path), cache_dir=str(tmp_path / "cache")), splits=Splits(test="train"))
    with pytest.raises(ValueError, match="no source row"):
        data.source_row(0)


def test_exclude_from_predict_leaves_those_examples_out(tmp_path):
    data = DLLMDataModule(DataSource(path="task:add", cache_dir=str(tmp_path)), loader=Loader(batch_size=4),
                          task=BuiltinTask(num_train=32, num_val=10))
    data.exclude_from_predict([1, 2, 7])
    indices = [i for batch in data.predict_dataloader() for i in batch["example_index"].tolist()]
    assert indices == [0, 3, 4, 5, 6, 8, 9]
    assert len(data.test_dataloader().dataset) == 10  # test keeps every example


# ---------------------------------------------------------------------------- evaluation without --ckpt_path


@pytest.mark.parametrize("subcommand", ["validate", "predict"])
def test_pretrained_weights_are_scored_without_a_checkpoint(workdir, subcommand, caplog):
    with caplog.at_level(logging.INFO):
        cli = main([subcommand, "--config", str(REPO / "configs" / "ar_tiny.yaml"), *TINY_OVERRIDES[:-1],
                    f"--model.init_args.backbone={{model: {MODEL}, model_config: null}}",  # a null field: whole group
                    f"--data.init_args.tokenizer.name={MODEL}", "--trainer.limit_val_batches=1",
                    "--trainer.limit_predict_batches=1", f"--trainer.logger.init_args.save_dir={workdir}"])
    assert f"No --ckpt_path: scoring the pretrained weights of backbone.model {MODEL}" in caplog.text
    assert cli.trainer.ckpt_path is None
    if subcommand == "validate":
        assert "val/loss" in cli.trainer.callback_metrics
    else:
        assert cli.trainer.predict_loop.predictions[0]


@pytest.mark.parametrize(("config", "unset"), [("ar_tiny", "model.init_args.backbone.model"),
                                               ("dflash_tiny", "model.init_args.draft")])
@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_random_init_weights_need_a_checkpoint(tmp_path, config, unset, subcommand, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([subcommand, "--config", f"configs/{config}.yaml", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "without --ckpt_path would score a randomly initialised model" in err
    assert unset in err and "--ckpt_path last" in err


def test_a_split_of_empty_responses_is_a_clear_error(tmp_path):
    """E.g. a regenerated file whose answers are all empty: named, not a datasets column error."""
    path = tmp_path / "empty.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": " "}) + "\n" for i in range(4)))
    data = DLLMDataModule(DataSource(path=str(path), prompt_field="question", response_field="answer",
                                     cache_dir=str(tmp_path / "c")))
    with pytest.raises(ValueError, match="All 3 train examples .* have an empty response: check the column 'answer'"):
        data.setup()
