"""The one hand-off between the data module and the module (issue 58, docs/DESIGN.md §2.3): the module states what
it requires of its batches, the data module checks it and answers with its tokenizer and ``max_seq_len``; at the
module's ``setup``, once. Neither side reads the trainer for the other."""

import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import yaml

import lit_dllm
from lit_dllm import BlockDiffusionGemmaModule, DLLMCollator, DLLMDataModule, MDLMModule
from lit_dllm.data.handoff import DataFacts, DataNeeds
from lit_dllm.families.mdlm.module import LLaDAGenerationMixin
from lit_dllm.settings import BuiltinTask, Collation, DataSource
from lit_dllm.testing import TINY_DIFFUSION_GEMMA, TINY_LLAMA

PACKAGE = Path(lit_dllm.__file__).parent


def data(**collation) -> DLLMDataModule:
    return DLLMDataModule(DataSource(path="task:reverse"), collation=Collation(**collation), max_seq_len=32,
                          task=BuiltinTask(num_train=16, num_val=8), loader={"batch_size": 4})


def mdlm(dm: DLLMDataModule, **settings) -> MDLMModule:
    return MDLMModule(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                      backbone={"model_config": dict(TINY_LLAMA)}, generation={"val_generate_batches": 0}, **settings)


def test_the_data_module_answers_what_the_module_needs_with_its_tokenizer_and_row_length():
    dm = data()
    facts = dm.connect(DataNeeds("SomeModule"))
    assert facts == DataFacts(dm.tokenizer, 32, dm.loader.batch_size, None)
    module = mdlm(dm)
    assert module.data_max_seq_len is None
    module.connect(facts)
    assert module.tokenizer is dm.tokenizer and module.data_max_seq_len == 32


@pytest.mark.parametrize("rounded, canvas_multiple, warns", [(None, None, False), (8, None, True), (8, 8, False),
                                                             (8, 16, False), (1, None, False)])
def test_a_sampler_whose_rows_are_not_rounded_as_the_training_rows_are_warned_of(rounded, canvas_multiple, warns):
    dm = data(pad_seq_len_divisible=rounded)
    facts = dm.connect(DataNeeds("SomeModule"))
    assert facts.row_multiple == rounded
    module = MDLMModule(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                        backbone={"model_config": dict(TINY_LLAMA)}, generation={"gen_canvas_multiple": canvas_multiple})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.connect(facts)
    said = [str(w.message) for w in caught if "gen_canvas_multiple" in str(w.message)]
    assert len(said) == warns
    if warns:
        assert "rounded up to a multiple of 8 tokens" in said[0] and "gen_canvas_multiple: 8" in said[0]
    assert data(pad_seq_len_divisible=8, pack=True).connect(DataNeeds("Packed")).row_multiple is None


def test_the_data_module_refuses_what_it_cannot_give_naming_the_module_and_the_setting():
    needs = DataNeeds("Canvas", {"pad_block_size": 4, "response_window": True})
    with pytest.raises(ValueError, match=r"^Canvas requires a collation .*set data.init_args.collation.pad_block_size: "
                                         r"4 and data.init_args.collation.response_window: true\.$"):
        data().connect(needs)
    with pytest.raises(TypeError, match=r"Canvas.required_collation\(\) names \['canvas'\]"):
        data().connect(DataNeeds("Canvas", {"canvas": 4}))
    cannot = DataNeeds("Rows", packing_problem=lambda fill: f"fill {fill}")
    with pytest.raises(ValueError, match=r"collation.pack: true, but Rows cannot train on packed rows: fill 4\."):
        data(pack=True, pad_block_size=4).connect(cannot)
    data().connect(cannot)  # not packed: nothing to refuse


def test_a_tokenizer_whose_mask_is_not_the_modules_is_refused_at_the_handoff():
    dm = data()
    other = next(i for i in range(dm.vocab_size) if i not in (dm.mask_token_id, dm.pad_token_id, dm.eos_token_id))
    module = MDLMModule(vocab_size=dm.vocab_size, mask_token_id=other, pad_token_id=dm.pad_token_id,
                        backbone={"model_config": dict(TINY_LLAMA)})
    with pytest.raises(ValueError, match="differs from the model's mask_token_id"):
        module.connect(dm.connect(module.data_needs()))


def test_a_fit_connects_the_two_at_setup_before_the_model_is_built():
    dm = data()
    module = mdlm(dm)
    trainer = L.Trainer(accelerator="cpu", logger=False, max_steps=1, limit_val_batches=0, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, dm)
    assert module.tokenizer is dm.tokenizer and module.data_max_seq_len == dm.max_seq_len
    gemma = BlockDiffusionGemmaModule(vocab_size=dm.vocab_size, backbone={"model_config": TINY_DIFFUSION_GEMMA})
    with pytest.raises(ValueError, match="^BlockDiffusionGemmaModule requires a collation"):
        L.Trainer(accelerator="cpu", logger=False, max_steps=1, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False).fit(gemma, data())
    assert gemma.model is None


def test_neither_side_reads_the_trainer_for_the_other():
    reach = re.compile(r"getattr\([^)]*[\"'](datamodule|lightning_module)[\"']|\.lightning_module\b")
    found = [f"{path.relative_to(PACKAGE)}" for room in ("core", "data") for path in (PACKAGE / room).rglob("*.py")
             if reach.search(path.read_text())]
    assert found == []


def test_every_bundled_denoiser_samples_rows_as_wide_as_its_training_rows():
    """configs/: an MDLM or hybrid config whose collation rounds rows sets ``gen_canvas_multiple`` to that multiple, so
    its set-up does not warn and its answers are read on widths it trained on."""
    checked = []
    for path in sorted((PACKAGE.parent / "configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        model, collation = config.get("model", {}), config.get("data", {}).get("init_args", {}).get("collation", {})
        cls = getattr(lit_dllm, model.get("class_path", "").removeprefix("lit_dllm."), None)
        divisible = collation.get("pad_seq_len_divisible") or 1
        if not (isinstance(cls, type) and issubclass(cls, LLaDAGenerationMixin)) or divisible == 1:
            continue
        multiple = DLLMCollator(block_size=model["init_args"].get("block_size"), pad_seq_len_divisible=divisible
                                ).row_multiple
        assert model["init_args"]["generation"].get("gen_canvas_multiple") == multiple, path.name
        checked.append(path.name)
    assert {"mdlm_tiny.yaml", "hybrid_tiny.yaml", "mdlm_smollm2_arith.yaml", "mdlm_smollm2_gsm8k.yaml"} <= set(checked)
