"""The LightningCLI behind ``train.py``: model and data chosen by class, tokenizer facts linked."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.modules.base import DLLMModule

LINKED_FROM_DATA = ("vocab_size", "mask_token_id", "pad_token_id", "eos_token_id")


class DLLMCLI(LightningCLI):
    """``fit | validate | test | predict`` for any :class:`DLLMModule` on any :class:`DLLMDataModule`.

    The tokenizer's vocabulary size and special ids are computed by the data module and linked into
    the model, so a config never repeats them.
    """

    def add_arguments_to_parser(self, parser) -> None:
        for name in LINKED_FROM_DATA:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        parser.link_arguments("data.init_args.tokenizer", "model.init_args.tokenizer")

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        self.model.tokenizer = self.datamodule.tokenizer  # the very object that tokenised the data


def main(args=None) -> DLLMCLI:
    return DLLMCLI(
        DLLMModule,
        DLLMDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
