"""The LightningCLI behind ``train.py``: model and data chosen by class, tokenizer facts linked."""

from __future__ import annotations

from argparse import RawDescriptionHelpFormatter

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningCLI

from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.modules.base import DLLMModule

DESCRIPTION = """Train, validate and sample diffusion language models (lit_dllm).

Start with a config from configs/ and override any key on the command line:
  python train.py fit --config configs/mdlm_tiny.yaml                 # the tiny CPU demo
  python train.py fit --config configs/hybrid_tiny.yaml               # hybrid diffusion + AR
  python train.py fit --config configs/mdlm_tiny.yaml --trainer.max_steps=200 --data.init_args.data=task:sort
  python train.py fit --config configs/mdlm_tiny.yaml --ckpt_path last   # resume
  python train.py predict --config configs/mdlm_tiny.yaml --ckpt_path last
  python train.py fit --config configs/mdlm_tiny.yaml --print_config  # the full, editable config
Models: lit_dllm.MDLMModule, lit_dllm.HybridMDLMModule (model.class_path); data: lit_dllm.DLLMDataModule.
`python train.py fit --help` lists every option; vocabulary size and special token ids are linked
from the data module's tokenizer, so configs never repeat them."""



class HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, keeping the description's line breaks."""


LINKED_FROM_DATA = ("vocab_size", "mask_token_id", "pad_token_id", "eos_token_id")


class DLLMCLI(LightningCLI):
    """``fit | validate | test | predict`` for any :class:`DLLMModule` on any :class:`DLLMDataModule`.

    The tokenizer's vocabulary size and special ids are computed by the data module and linked into
    the model, so a config never repeats them.
    """

    def add_arguments_to_parser(self, parser) -> None:
        for name in LINKED_FROM_DATA:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        for name in ("tokenizer", "trust_remote_code"):  # one knob each for the tokenizer and the model
            parser.link_arguments(f"data.init_args.{name}", f"model.init_args.{name}")

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
        parser_kwargs={"description": DESCRIPTION, "formatter_class": HelpFormatter},
        args=args,
    )
