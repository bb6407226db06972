"""Adding a family (docs/DESIGN.md §2.4) takes its folder, an export line and a config: the CLI's help then lists it,
``train.py fit --config`` trains it and the evaluation harness scores it through the hooks its base provides."""

import sys

import pytest
import torch
import yaml

import lit_dllm
from lit_dllm.cli import description, main, models
from lit_dllm.testing import TINY_LLAMA

FAMILY = "prompt_count"
"""The new family's package, written into a temporary folder on ``sys.path``."""

MODULE_PY = '''
"""A causal LM that also logs how many prompt tokens each step read."""

from lit_dllm import CausalLMModule


class PromptCountLMModule(CausalLMModule):
    def token_sums(self, batch, prepared):
        prompt = batch["attention_mask"].bool() & ~batch["loss_mask"].bool()
        return {**super().token_sums(batch, prepared), "prompt_tokens": prompt.sum()}

    tiny_config = CONFIG
'''


@pytest.fixture
def new_family(tmp_path, monkeypatch):
    """The family's folder and config, and its export line (``lit_dllm.PromptCountLMModule``); the class."""
    config = tmp_path / "prompt_count_tiny.yaml"
    config.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": 100, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "num_sanity_val_steps": 0,
                    "limit_val_batches": 0, "default_root_dir": str(tmp_path)},
        "model": {"class_path": "lit_dllm.PromptCountLMModule",
                  "init_args": {"backbone": {"model_config": TINY_LLAMA}}},
        "data": {"class_path": "lit_dllm.DLLMDataModule",
                 "init_args": {"source": {"path": "task:reverse"}, "max_seq_len": 32, "loader": {"batch_size": 8},
                               "task": {"num_train": 64, "num_val": 8}}},
    }))
    folder = tmp_path / FAMILY
    folder.mkdir()
    (folder / "__init__.py").write_text('"""A new family: module.py."""\n')
    (folder / "module.py").write_text(MODULE_PY.replace("CONFIG", repr(str(config))))
    monkeypatch.syspath_prepend(str(tmp_path))
    from prompt_count.module import PromptCountLMModule  # the export line of lit_dllm/__init__.py

    monkeypatch.setattr(lit_dllm, "PromptCountLMModule", PromptCountLMModule, raising=False)
    monkeypatch.setattr(lit_dllm, "__all__", [*lit_dllm.__all__, "PromptCountLMModule"])
    yield PromptCountLMModule, config
    for name in (f"{FAMILY}.module", FAMILY):
        sys.modules.pop(name)


def test_a_family_is_its_folder_an_export_line_and_a_config(new_family):
    cls, config = new_family
    assert models()["lit_dllm.PromptCountLMModule"] == str(config)
    assert ["lit_dllm.PromptCountLMModule", str(config)] in [line.split() for line in description().splitlines()]

    cli = main(["fit", "--config", str(config), "--trainer.max_steps=2"])
    assert type(cli.model) is cls and cli.trainer.global_step == 2
    assert cli.trainer.callback_metrics["train/prompt_tokens"] > 0  # the family's own hook ran

    pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    from lit_dllm.eval import LitDLLMEval

    lm = LitDLLMEval(module=cli.model)
    [(score, _)] = lm.loglikelihood([SimpleNamespace(args=("rev 12=", "21"))])
    assert score == cli.model.exact_scores([lm.pair("rev 12=", "21")], batch_size=1)[0][0] and score < 0
    assert torch.isfinite(torch.tensor(lm.loglikelihood_rolling([SimpleNamespace(args=("hello",))])[0]))
