"""Every setting that a message of lit_dllm names in full (``model.init_args.block_size``, ``data.init_args.tokenizer.
mask_token``, ``trainer.max_steps``) is a key that ``train.py fit --config ... --<key>`` accepts (issue 58: hints
named ``model.block_size``, ``data pad_block_size`` and ``data.mask_token``, which do not parse)."""

import ast
import re
from pathlib import Path

import pytest

import lit_dllm
from lit_dllm.cli import DLLMCLI, models
from lit_dllm.core.token_loss import TokenLossModule
from lit_dllm.data.datamodule import DLLMDataModule

PACKAGE = Path(lit_dllm.__file__).parent
KEY = re.compile(r"(?<![\w.\-/'])(model|data|trainer)\.([a-z_]+(?:\.[a-z_]+)*)")
SUBMODULE_PATHS = {"model.hf", "model.target", "model.hf.model.embed_tokens"}
"""Dotted paths of a module's submodules (``frozen_modules`` names them), not settings."""
FILE_NAMES = re.compile(r"model\.safetensors")


class ParseOnly(DLLMCLI):
    """The CLI's parser with a config read, nothing built."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


def message_keys() -> dict[str, list[str]]:
    """Each full setting key named by a string of lit_dllm's code (docstrings left out) -> where."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for match in KEY.finditer(node.value):
                    key = match.group(0)
                    if key not in SUBMODULE_PATHS and not FILE_NAMES.match(key):
                        found.setdefault(key, []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


@pytest.fixture(scope="module")
def parsed() -> list:
    """The parsed config of each family's tiny config (every model key of the shipped families is in one)."""
    return [ParseOnly(TokenLossModule, DLLMDataModule, subclass_mode_model=True, subclass_mode_data=True,
                      auto_configure_optimizers=False, args=["--config", config], run=False).config
            for config in sorted(set(models().values()))]


def accepted(key: str, configs: list) -> bool:
    """Whether ``key`` is a key of a parsed config (a trainer key: its first part, the rest is its class's)."""
    if key.startswith("trainer."):
        key = ".".join(key.split(".")[:2])
    return any(key in config for config in configs)


def test_every_setting_a_message_names_parses(parsed):
    keys = message_keys()
    assert "model.init_args.block_size" in keys and "data.init_args.tokenizer.mask_token" in keys  # the scan finds them
    wrong = {key: places for key, places in keys.items() if not accepted(key, parsed)}
    assert wrong == {}


def test_the_check_refuses_the_spellings_issue_58_found(parsed):
    for key in ("model.block_size", "data.mask_token", "data.mask_token_id", "model.generation.gen_length"):
        assert not accepted(key, parsed), key


def test_no_message_names_a_setting_by_its_owner_and_a_space():
    """``set data pad_block_size``: a key the scan above cannot see, so none may be written that way."""
    spaced = re.compile(r"\b[Ss]et (?:model|data|trainer) [a-z_]+")
    found = [path.name for path in PACKAGE.rglob("*.py") if spaced.search(path.read_text())]
    assert found == []
