"""Compiled transformer blocks (the strategy's ``parallelism.compile``: :func:`lit_dllm.parallel.apply_compile`) on CPU.

Inductor needs a C++ build, too slow for a 2-core CI box, so the tests set ``COMPILE_BACKEND`` to a backend that counts
its compilations and runs Dynamo's graphs eagerly: ``aot_eager`` for MDLM (AOT autograd's forward and backward graphs,
what inductor would receive), ``eager`` elsewhere (Dynamo's capture and guards). ``tests/test_compile_cuda.py`` runs
inductor on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import lit_dllm.parallel as parallel
from lit_dllm import (
    BuiltinTask,
    CausalBackbone,
    Collation,
    DataSource,
    DLLMDataModule,
    Loader,
    Parallelism,
    SingleDeviceStrategy,
    build_default_tokenizer,
)
from lit_dllm.families.causal_lm.module import CausalLMModule
from lit_dllm.families.mdlm.module import HybridMDLMModule, MDLMModule
from lit_dllm.strategies import init_meshes
from lit_dllm.testing import TINY_LLAMA

from .test_parallel import STEPS, _gloo_group, _sharded, _spawn, make_module, make_optimizer, one_thread, train
from .test_parallel import relative_differences

TOK = build_default_tokenizer()


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles and hands them to ``inner``."""

    def __init__(self, inner: str):
        self.compiles, self.inner = 0, lookup_backend(inner)

    def __call__(self, graph, example_inputs):
        self.compiles += 1
        return self.inner(graph, example_inputs)


@pytest.fixture
def backend(monkeypatch, request):
    counting = CountingBackend(getattr(request, "param", "eager"))
    monkeypatch.setattr(parallel, "COMPILE_BACKEND", counting)
    torch._dynamo.reset()  # no graph compiled by an earlier test is reused
    return counting


class Lengths(L.Callback):
    """The padded length of every training batch, and the compilations so far after each."""

    def __init__(self, backend: CountingBackend):
        self.backend, self.lengths, self.compiles = backend, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lengths.append(batch["input_ids"].shape[1])
        self.compiles.append(self.backend.compiles)


def fit(module, backend, steps: int = 8, parallelism: Parallelism = Parallelism(),
        **trainer_args) -> tuple[L.Trainer, list[float], Lengths]:
    """Train on the reverse task, 2 rows a batch padded to a multiple of 4 (a new length nearly every batch), on one
    CPU under the run settings ``parallelism``."""
    dm = DLLMDataModule(
        DataSource(path="task:reverse"), loader=Loader(batch_size=2), max_seq_len=96,
        collation=Collation(pad_seq_len_divisible=4),
        task=BuiltinTask(num_train=64, num_val=4, kwargs={"min_len": 1, "max_len": 32}),
    )
    lengths, losses = Lengths(backend), []

    class RecordLoss(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(parallelism=parallelism),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[lengths, RecordLoss()], **trainer_args,
    )
    trainer.fit(module, dm)
    return trainer, losses, lengths


def tiny(cls=MDLMModule, **kwargs):
    torch.manual_seed(0)
    mask = {} if cls is CausalLMModule else {"mask_token_id": TOK.mask_token_id}
    return cls(
        vocab_size=len(TOK), pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id,
        backbone=CausalBackbone(model_config=TINY_LLAMA), generation={"val_generate_batches": 0}, **mask, **kwargs,
    )


def test_each_block_is_compiled_once_in_place(backend):
    module = tiny()
    module.configure_model()
    keys = list(module.state_dict())
    originals = [layer.forward for layer in module.model.hf.model.layers]
    parallel.parallelize(module.model, SimpleNamespace(), compile=True)  # no mesh: a single device
    for block, original in zip(module.model.hf.model.layers, originals, strict=True):
        assert block.forward._torchdynamo_orig_callable == original  # compiled once, around the eager forward
    assert list(module.state_dict()) == keys  # no `_orig_mod.`: checkpoints load with compile on or off
    module.model(torch.randint(3, len(TOK), (2, 16)))
    assert backend.compiles == 1  # both layers share one graph


def test_compile_is_off_on_cpu_by_default(backend):
    trainer, _, _ = fit(tiny(), backend, steps=1)
    assert backend.compiles == 0
    assert not hasattr(trainer.lightning_module.model.hf.model.layers[0].forward, "_torchdynamo_orig_callable")


@pytest.mark.parametrize("backend", ["aot_eager"], indirect=True)
def test_bucketed_lengths_compile_twice_and_losses_equal_eager(backend, tmp_path):
    """Automatic dynamic shapes: the first length compiles static, the second once more with a symbolic length, and
    the other lengths reuse it; evaluation (``eval()`` + ``no_grad``) adds one. fp32 losses equal eager's."""
    _, eager, _ = fit(tiny(), backend, parallelism=Parallelism(compile=False))
    assert backend.compiles == 0
    trainer, compiled, lengths = fit(tiny(), backend, parallelism=Parallelism(compile=True), default_root_dir=tmp_path)
    assert len(set(lengths.lengths)) >= 5, lengths.lengths
    assert lengths.compiles[-1] <= 2, list(zip(lengths.lengths, lengths.compiles))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    trainer.validate(trainer.lightning_module, trainer.datamodule, verbose=False)
    assert backend.compiles <= 3
    path = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    eager_module = tiny()
    eager_module.configure_model()
    eager_module.load_state_dict(state)  # strict: the same keys


@pytest.mark.parametrize("cls", [HybridMDLMModule, CausalLMModule])
def test_other_families_equal_eager(backend, cls):
    """The hybrid step (a causal pass with an explicit mask beside the bidirectional one) and plain AR."""
    _, eager, _ = fit(tiny(cls), backend, steps=2, parallelism=Parallelism(compile=False))
    _, compiled, _ = fit(tiny(cls), backend, steps=2, parallelism=Parallelism(compile=True))
    assert backend.compiles > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def _gloo_worker(rank: int, world: int, port: int, out: str) -> None:
    parallel.COMPILE_BACKEND = "eager"
    results = {}
    with _gloo_group(rank, world, port):
        for name, ep in (("fsdp2", 1), ("fsdp2+ep2+checkpointing", 2)):
            meshes = init_meshes(world, ep, "cpu")
            module, optimizer = _sharded(meshes, compile=True, activation_checkpointing=ep > 1)
            results[name] = train(module, optimizer, range(STEPS // 2), meshes, rank)
        if rank == 0:
            torch.save(results, f"{out}/results.pt")


def test_fsdp2_and_expert_parallel_with_compiled_blocks_follow_the_single_process_run(tmp_path):
    """Two gloo ranks, the tiny Qwen3-MoE MDLM: compiled blocks under FSDP2, and under FSDP2 + EP=2 with activation
    checkpointing (experts eager inside the compiled blocks), step for step equal to one eager process."""
    with one_thread():
        module = make_module()
        reference = train(module, make_optimizer(module), range(STEPS // 2))
    for name, history in _spawn(_gloo_worker, 2, tmp_path).items():
        assert max(relative_differences(history, reference)) < 1e-5, name
