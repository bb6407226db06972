"""Issue 49: the harness model says what ``checkpoint=`` expected and found, refuses ``module=`` of another family than
the checkpoint's, and ``--model lit_dllm`` resolves through the command that works (and lm-eval's entry points)."""

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lit_dllm import HybridMDLMModule, MDLMModule  # noqa: E402
from lit_dllm.checkpointing import TOKENIZER_KEY, tokenizer_files  # noqa: E402
from lit_dllm.eval import LitDLLMEval, gsm8k_task_dir  # noqa: E402
from tests.eval.test_harness import TOK, mdlm  # noqa: E402

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """An MDLM checkpoint that records its class, as train.py writes it."""
    module = mdlm()
    path = tmp_path_factory.mktemp("ckpt") / "mdlm.ckpt"
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": "2.6.6",
                "hyper_parameters": {**module.hparams, "_class_path": "lit_dllm.MDLMModule",
                                     "_instantiator": "lightning.pytorch.cli.instantiate_module"},
                TOKENIZER_KEY: tokenizer_files(TOK)}, path)
    return path


def test_checkpoint_names_what_it_expected_and_found(tmp_path):
    expected = r"checkpoint= takes a Lightning checkpoint file \(a \.ckpt that fit writes"
    with pytest.raises(ValueError, match=rf"'{tmp_path}' is a folder without checkpoints; {expected}"):
        LitDLLMEval(checkpoint=str(tmp_path))
    (tmp_path / "last.ckpt").touch()
    with pytest.raises(ValueError, match=r"is a folder holding \['last.ckpt'\]: pass one of them"):
        LitDLLMEval(checkpoint=str(tmp_path))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"is a Hugging Face model folder: pass pretrained={hf} instead"):
        LitDLLMEval(checkpoint=str(hf))
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ValueError, match=r"notes.txt' is not a Lightning checkpoint file .*starts with b'hello'"):
        LitDLLMEval(checkpoint=str(notes))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "weights.pt")
    with pytest.raises(ValueError, match=r"holds a dict without a state_dict, not a Lightning checkpoint"):
        LitDLLMEval(checkpoint=str(tmp_path / "weights.pt"))
    with pytest.raises(FileNotFoundError, match=r"missing.ckpt' does not exist"):
        LitDLLMEval(checkpoint=str(tmp_path / "missing.ckpt"))


def test_module_of_another_family_names_both_classes(recorded):
    with pytest.raises(ValueError, match=r"module=CausalLMModule is another family than checkpoint=.*trained as "
                                         r"MDLMModule \(lit_dllm.MDLMModule\): drop module="):
        LitDLLMEval(checkpoint=str(recorded), module="lit_dllm.CausalLMModule")
    assert type(LitDLLMEval(checkpoint=str(recorded), module="HybridMDLMModule").module) is HybridMDLMModule
    assert type(LitDLLMEval(checkpoint=str(recorded)).module) is MDLMModule


def test_the_entry_point_resolves_through_lm_evals_registry():
    """lm-eval's registry loads an entry point of its ``lm_eval.models`` group lazily: ours names the model class."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import Registry

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["lm_eval.models"]
    registry = Registry("model", base_cls=LM)
    for name, value in declared.items():
        registry.register(name, target=importlib.metadata.EntryPoint(name, value, "lm_eval.models"))
    assert registry.get("lit_dllm") is LitDLLMEval


def test_the_documented_command_runs_the_model(tmp_path):
    """``python -m lit_dllm.eval run --model lit_dllm`` reaches LitDLLMEval (here: its checkpoint check), where lm-eval
    0.4.13's own ``python -m lm_eval`` knows no such model; the package's docs give the command that works."""
    import lit_dllm.eval

    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1", "answer": "#### 2"}\n')
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    args = ["run", "--model", "lit_dllm", "--model_args", f"checkpoint={notes}", "--tasks", "gsm8k_local",
            "--include_path", str(gsm8k_task_dir(data, tmp_path / "tasks")), "--device", "cpu"]
    ours = subprocess.run([sys.executable, "-m", "lit_dllm.eval", *args], capture_output=True, text=True, cwd=ROOT)
    assert ours.returncode != 0 and "notes.txt' is not a Lightning checkpoint file" in ours.stderr
    probe = "from lm_eval.api.registry import get_model; print(get_model('lit_dllm').__name__)"
    theirs = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert theirs.stdout.strip() == "LitDLLMEval" or "no model for this name" in theirs.stderr
    assert "python -m lit_dllm.eval run --model lit_dllm" in lit_dllm.eval.__doc__
