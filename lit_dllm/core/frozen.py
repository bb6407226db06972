"""Which weights train and what checkpoints hold (:class:`FrozenWeightsMixin`): frozen modules stay out of the
optimizer, in ``eval()`` mode, and out of checkpoints (unless ``save_frozen``), as do a LoRA run's pretrained base
weights; ``build_model`` rebuilds them when a checkpoint loads. Optimizer states are saved by parameter name, so a
checkpoint resumes under any strategy."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lit_dllm.checkpointing import name_optimizer_states


class FrozenWeightsMixin:
    """For a LightningModule with ``model``, ``frozen_modules``, ``save_frozen``, ``lora`` and ``backbone``."""

    _trained_keys: set[str] | None = None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        for key in [key for key in checkpoint["state_dict"] if self.rebuilt(key)]:
            del checkpoint["state_dict"][key]
        name_optimizer_states(checkpoint, self, self.trainer.optimizers)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("state_dict")  # what a checkpoint leaves out comes from build_model
        if saved is None:  # a sharded checkpoint: the strategy loaded the weights into the model already
            return
        adapters = [key for key in saved if ".lora_" in key]
        if adapters and self.lora is None:
            raise ValueError(
                f"This checkpoint holds LoRA adapters ({len(adapters)} tensors, e.g. {adapters[0]}) but the module has "
                "lora=None: load it with its own settings (leave lora unset: the checkpoint's hyper-parameters hold "
                "them), or export a merged model from it (save_pretrained) and load that without LoRA."
            )
        saved.update({k: v for k, v in self.state_dict().items() if k not in saved and self.rebuilt(k)})

    def frozen(self) -> list[nn.Module]:
        """The ``frozen_modules``, resolved (a clear error names a wrong dotted name)."""
        modules = []
        for name in self.frozen_modules:
            try:
                modules.append(self.get_submodule(name))
            except AttributeError as err:
                raise ValueError(
                    f"frozen_modules: no submodule {name!r} ({err}); names are dotted paths from the module, e.g. "
                    "'model.hf.model.embed_tokens'."
                ) from err
        return modules

    def train(self, mode: bool = True):
        """Switch train/eval mode; frozen modules stay in eval mode."""
        super().train(mode)
        if self.model is not None:
            for module in self.frozen():
                module.eval()
        return self

    def rebuilt(self, key: str) -> bool:
        """Whether the state-dict ``key`` stays out of checkpoints because ``build_model`` rebuilds it: frozen modules
        (unless ``save_frozen``), and with ``lora`` on a pretrained ``backbone.model`` every base weight, except in
        sharded (FSDP2) checkpoints, which torch's distributed loader reads key for key (each rank holds 1/N of the
        base)."""
        if not self.save_frozen and key.startswith(tuple(f"{name}." for name in self.frozen_modules)):
            return True
        pretrained = self.backbone is not None and self.backbone.model is not None
        if self.lora is None or not pretrained or not key.startswith("model.") or isinstance(self.model, FSDPModule):
            return False
        if self._trained_keys is None:
            self._trained_keys = {n for n, p in self.named_parameters(remove_duplicate=False) if p.requires_grad}
        return key not in self._trained_keys
