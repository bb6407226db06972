"""FP8 training (the strategy's ``parallelism.fp8``, :mod:`lit_dllm.fp8`) without a GPU.

torch's CPU build runs ``torch._scaled_mm`` too (slowly), so converted models train here: which layers convert (tiny
Llama MDLM, DiffusionGemma, DFlash), state dicts and checkpoints that are the plain model's (an fp8 run resumes a plain
checkpoint, compiled, and its checkpoint loads with fp8 off), FSDP2 with float8 all-gather on two gloo ranks, when the
float8 scales are precomputed, and the errors. :class:`~lit_dllm.fp8.Float8Converter` refuses a CPU (float8 pays off
only on float8 tensor cores), so the runs here patch that check out. Loss parity with bf16 on a GPU:
``tests/test_fp8_cuda.py``.
"""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import lit_dllm.fp8 as fp8
from lit_dllm import (
    BuiltinTask,
    CausalBackbone,
    CausalLMModule,
    DataSource,
    DLLMDataModule,
    Loader,
    HybridMDLMModule,
    MDLMModule,
    Parallelism,
    SingleDeviceStrategy,
)
from lit_dllm.fp8 import RECIPES, Float8Converter, apply_fp8, check_fp8_device
from lit_dllm.meshes import grad_norm
from lit_dllm.parallel import export_hf, parallelize
from lit_dllm.strategies import init_meshes
from lit_dllm.testing import TINY_LLAMA

from .families.dflash.test_dflash import dflash
from .families.diffusion_gemma.test_diffusion_gemma import gemma
from .core.test_resume_and_errors import RecordLosses
from .core.test_training_step import collate, make_examples
from .test_compile import backend  # noqa: F401  (a fixture)
from .test_parallel import GLOBAL_BATCH, STEPS, TOLERANCE, _gloo_group, _spawn, make_module, make_optimizer
from .test_parallel import relative_differences, train

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="needs torchao: pip install -e '.[fp8]'")
VOCAB = 64  # a multiple of 16: the LM head would qualify by its shape, and stays out because it is no block's
PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]
LLAMA_PROJECTIONS = [f"hf.model.layers.{i}.{name}" for i in range(2) for name in PROJECTIONS]


def tiny_mdlm(**config) -> MDLMModule:
    torch.manual_seed(0)
    module = MDLMModule(vocab_size=VOCAB, mask_token_id=VOCAB - 1,
                        backbone=CausalBackbone(model_config={**TINY_LLAMA, **config}),
                        generation={"val_generate_batches": 0})
    module.configure_model()
    return module


def float8_linears(model: nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


def saved_and_loaded(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ------------------------------------------------------------------------------------------- which layers convert
@needs_torchao
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "fsdp-all-gather"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_llama_mdlm_converts_the_seven_projections_of_each_block_and_keeps_its_state_dict(recipe, sharded):
    model = tiny_mdlm().model
    keys = list(model.state_dict())
    assert apply_fp8(model, recipe, sharded) == LLAMA_PROJECTIONS
    assert float8_linears(model) == LLAMA_PROJECTIONS
    configs = {model.get_submodule(name).config for name in LLAMA_PROJECTIONS}
    assert len(configs) == 1
    config = configs.pop()
    granularity = {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]
    assert config.cast_config_input.scaling_granularity.value == granularity
    assert config.enable_fsdp_float8_all_gather == (sharded and recipe == "tensorwise")
    assert type(model.hf.lm_head) is nn.Linear and type(model.hf.model.embed_tokens) is nn.Embedding
    other = tiny_mdlm(initializer_range=1.0).model.state_dict()  # plain weights of other values
    model.load_state_dict(other)  # a plain checkpoint into the fp8 model
    saved = saved_and_loaded(model.state_dict())
    assert list(saved) == keys
    plain = tiny_mdlm().model
    plain.load_state_dict(saved)  # and the fp8 model's into a plain one
    for key, value in plain.state_dict().items():
        assert torch.equal(value, other[key]), key


@needs_torchao
@pytest.mark.parametrize("family", [HybridMDLMModule, CausalLMModule])
def test_hybrid_and_causal_lm_convert_the_same_projections(family):
    module = family(vocab_size=VOCAB, mask_token_id=VOCAB - 1, backbone=CausalBackbone(model_config=TINY_LLAMA),
                    generation={"val_generate_batches": 0})
    module.configure_model()
    assert apply_fp8(module.model, "rowwise") == LLAMA_PROJECTIONS


@needs_torchao
def test_layers_whose_features_are_not_multiples_of_16_keep_their_precision():
    model = tiny_mdlm(intermediate_size=40).model  # the MLP's 32 -> 40 -> 32
    assert apply_fp8(model, "tensorwise") == [name for name in LLAMA_PROJECTIONS if "attn" in name]


@needs_torchao
def test_gemma_converts_its_shared_stack_once_and_keeps_routers_experts_and_vision_tower():
    model = gemma(freeze_router=False).model  # trained routers: left out by their name, not for being frozen
    parameters = len(list(model.parameters()))
    names = apply_fp8(model, "tensorwise", sharded=True)  # the float8 all-gather wraps each weight anew
    # 4 layers x 7 projections, less the v_proj of the 2 full-attention layers, in the encoder and in the decoder
    assert len(names) == 2 * (4 * 7 - 2)
    assert not [name for name in names if "router" in name or "experts" in name or "vision" in name]
    encoder, decoder = model.hf.model.encoder.language_model.layers, model.hf.model.decoder.layers
    for encoder_layer, decoder_layer in zip(encoder, decoder, strict=True):
        assert encoder_layer.self_attn.q_proj.weight is decoder_layer.self_attn.q_proj.weight
        assert type(encoder_layer.router.proj) is nn.Linear
    assert len(list(model.parameters())) == parameters  # every tie kept


@needs_torchao
def test_dflash_converts_the_draft_and_leaves_its_frozen_target():
    model = dflash().model
    names = apply_fp8(model, "rowwise")
    assert names == [f"draft.layers.{i}.{name}" for i in range(2) for name in PROJECTIONS]
    assert float8_linears(model.target) == []


# ------------------------------------------------------------------------------------------------- a Lightning run
def fit(module, path: Path, steps: int, ckpt_path=None, parallelism: Parallelism = Parallelism(),
        record: L.Callback | None = None) -> L.Callback:
    """Train ``module`` on one CPU under the run settings ``parallelism`` to ``steps`` steps (``record``, by default
    :class:`RecordLosses`, a callback), saving ``last.ckpt`` in ``path``."""
    record = record or RecordLosses()
    dm = DLLMDataModule(DataSource(path="task:reverse"), loader=Loader(batch_size=8), max_seq_len=32,
                        task=BuiltinTask(num_train=64, num_val=8))
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(parallelism=parallelism),
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=path, callbacks=[record, L.pytorch.callbacks.ModelCheckpoint(dirpath=path, save_last=True)],
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return record


def reverse_mdlm(**kwargs) -> MDLMModule:
    torch.manual_seed(0)
    tokenizer = DLLMDataModule(DataSource(path="task:reverse")).tokenizer
    return MDLMModule(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      backbone=CausalBackbone(model_config=TINY_LLAMA), generation={"val_generate_batches": 0},
                      **kwargs)


@needs_torchao
@pytest.mark.parametrize("backend", ["aot_eager"], indirect=True)
def test_an_fp8_run_resumes_a_plain_checkpoint_compiled_and_its_checkpoint_loads_without_fp8(tmp_path, monkeypatch,
                                                                                            backend):
    fit(reverse_mdlm(), tmp_path / "plain", steps=2, parallelism=Parallelism(compile=False))
    monkeypatch.setattr(fp8, "check_fp8_device", lambda device: None)  # the CPU stands in for a GPU
    module = reverse_mdlm()
    record = fit(module, tmp_path / "fp8", steps=4, ckpt_path=tmp_path / "plain" / "last.ckpt",
                 parallelism=Parallelism(fp8="tensorwise", compile=True))
    assert float8_linears(module.model) == LLAMA_PROJECTIONS and backend.compiles > 0
    assert len(record.losses) == 2 and all(torch.isfinite(torch.tensor(record.losses)))
    restored = MDLMModule.load_from_checkpoint(tmp_path / "fp8" / "last.ckpt")  # no trainer: no fp8
    assert float8_linears(restored.model) == []
    trained = module.state_dict()
    for key, value in restored.state_dict().items():
        assert torch.equal(value, trained[key]), key


# ------------------------------------------------------------------------------------------------- FSDP2, gloo
def _fsdp_fp8_worker(rank: int, world: int, port: int, out: str) -> None:
    """Each recipe over FSDP2 through :class:`Float8Converter`, as the modules apply it: converted before
    ``parallelize``, run after each optimizer step (tensorwise: float8 all-gather, its scales precomputed then); the
    tensorwise model is exported from its shards. Rank 0 saves the histories."""
    fp8.check_fp8_device = lambda device: None  # the CPU stands in for a GPU (in this worker process only)
    results = {}
    with _gloo_group(rank, world, port):
        strategy = init_meshes(world, 1, "cpu")
        for recipe in RECIPES:
            module = make_module()
            converter = Float8Converter(recipe, torch.device("cpu"), sharded=True)
            converter.convert(module.model)
            parallelize(module.model, strategy)
            optimizer = make_optimizer(module)
            optimizer.register_step_post_hook(lambda *args, model=module.model, converter=converter:
                                              converter.after_optimizer_step(model))
            weight = module.model.hf.model.layers[0].self_attn.q_proj.weight.to_local()
            results[recipe] = train(module, optimizer, range(STEPS), strategy, rank), type(weight).__name__
            if recipe == "tensorwise":
                export_hf(module.model, strategy, Path(out) / "hf")
        if rank == 0:
            torch.save(results, Path(out) / "results.pt")


def train_as_two_ranks(module, optimizer) -> list[tuple[float, float]]:
    """:func:`~tests.test_parallel.train` of two data-parallel ranks in one process: float8 scales the activations
    of each rank's rows by their own amax, so both halves of each batch run apart, their gradients summed."""
    history = []
    for step in range(STEPS):
        batches = [collate(make_examples(n=GLOBAL_BATCH)[rank::2]) for rank in range(2)]
        prepared = [module.prepare_batch(batch, module.noise_keys(batch, step)) for batch in batches]
        total = sum(module.token_counts(batch, noisy)["diffusion"].float() for batch, noisy in zip(batches, prepared))
        loss = sum(module.compute_loss(batch, noisy, {"diffusion": total}).output.total_loss
                   for batch, noisy in zip(batches, prepared))
        loss.backward()
        norm = grad_norm(module.model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        history.append((loss.item(), norm.item()))
    return history


@needs_torchao
def test_fsdp2_follows_one_process_and_gathers_tensorwise_weights_in_float8(tmp_path):
    from transformers import AutoModelForCausalLM

    results = _spawn(_fsdp_fp8_worker, 2, tmp_path)
    for recipe in RECIPES:
        module = make_module()
        apply_fp8(module.model, recipe)
        reference = train_as_two_ranks(module, make_optimizer(module))
        history, weight_type = results[recipe]
        assert max(relative_differences(history, reference)) < TOLERANCE, recipe
        gathered_in_float8 = weight_type == "WeightWithDynamicFloat8CastTensor"
        assert gathered_in_float8 == (recipe == "tensorwise")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # the plain model's keys, whole tensors
    assert exported.state_dict().keys() == module.model.hf.state_dict().keys()


def test_fsdp_float8_weight_scales_are_precomputed_after_each_step_and_after_weights_are_loaded(tmp_path,
                                                                                                 monkeypatch):
    """Under FSDP2's float8 all-gather the gathered weights' scales come from the current weights: after each optimizer
    step and after a checkpoint's weights are loaded into the converted model (resuming, or ``load_state_dict``);
    none before the first step (each all-gather computes its own scale until then), nor for evaluation."""
    events = []
    monkeypatch.setattr(fp8, "check_fp8_device", lambda device: None)  # the CPU stands in for a GPU,
    monkeypatch.setattr(fp8, "uses_fp8_all_gather", lambda recipe, sharded: True)  # and it for FSDP2
    monkeypatch.setattr(fp8, "apply_fp8", lambda model, recipe, sharded=False: [])  # (the scales are the point)
    monkeypatch.setattr(fp8, "precompute_fp8_scales", lambda model: events.append("scales"))

    class Steps(L.Callback):
        def on_train_batch_start(self, *args):
            events.append("step")

    run = {"parallelism": Parallelism(fp8="tensorwise"), "record": Steps()}
    module = reverse_mdlm()
    fit(module, tmp_path, steps=2, **run)
    assert events == ["step", "scales", "step", "scales"]
    dm, batches = module.trainer.datamodule, {f"limit_{stage}_batches": 2 for stage in ("val", "test", "predict")}
    evaluator = L.Trainer(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(parallelism=run["parallelism"]),
                          logger=False, enable_progress_bar=False, enable_model_summary=False, **batches)
    evaluator.validate(module, dm)
    evaluator.test(module, dm)
    evaluator.predict(module, dm)
    assert events == ["step", "scales", "step", "scales"]
    events.clear()
    fit(reverse_mdlm(), tmp_path, steps=3, ckpt_path=tmp_path / "last.ckpt", **run)
    assert events == ["scales", "step", "scales"]  # the restored weights', then the third step's
    events.clear()
    module.load_state_dict(module.state_dict())
    assert events == ["scales"]


# ------------------------------------------------------------------------------------------------------- errors
def test_an_unknown_recipe_is_an_error_before_any_model_is_built():
    with pytest.raises(ValueError, match=r"fp8='fp4' is not a float8 recipe: use one of \('tensorwise', 'rowwise'\)"):
        SingleDeviceStrategy(parallelism=Parallelism(fp8="fp4"))


def test_fp8_with_lora_is_an_error_before_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setattr("lit_dllm.fp8.check_fp8_device", lambda device: None)  # as on a GPU with float8 cores
    with pytest.raises(ValueError, match="parallelism.fp8='rowwise' with lora is not supported"):
        fit(reverse_mdlm(lora={}), tmp_path, steps=1, parallelism=Parallelism(fp8="rowwise"))


def test_fp8_on_a_cpu_run_is_an_error_before_the_first_step(tmp_path):
    with pytest.raises(ValueError, match="fp8 training needs a CUDA GPU.*on cpu: set parallelism.fp8: null"):
        fit(reverse_mdlm(), tmp_path, steps=1, parallelism=Parallelism(fp8="tensorwise"))


def test_a_gpu_without_float8_tensor_cores_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"A100-SXM4-80GB has compute capability 8\.0: set parallelism\.fp8: null"):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0))  # an H100


def test_without_torchao_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an environment without torchao meets
    with pytest.raises(ImportError, match=r"fp8='tensorwise' needs torchao: pip install -e '\.\[fp8\]'"):
        apply_fp8(tiny_mdlm().model, "tensorwise")
