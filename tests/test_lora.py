"""LoRA through PEFT for every family (``lora=``, :mod:`lit_dllm.lora`), and the transformers exports.

Only the adapters train and sit in the optimizer (the base stays bit for bit); checkpoints on a pretrained base hold
the adapters alone and resume bit for bit; the merged export gives the adapted model's logits and the adapter export
reloads with PEFT; FSDP2 (and FSDP2 + EP) with LoRA follow one process on two gloo ranks and export from the shards;
an MDLM / hybrid export is a plain transformers folder whose model, reloaded by ``AutoModelForCausalLM``, answers
through ``llada_generate`` / ``fast_generate`` exactly as the module does; bad LoRA input is a clear error.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, DiffusionGemmaForBlockDiffusion

from lit_dllm import (
    BlockDiffusionGemmaModule,
    CausalBackbone,
    CausalLMModule,
    HybridMDLMModule,
    LLaDAGeneration,
    MDLMModule,
    Optimization,
    Parallelism,
    llada_generate,
)
from lit_dllm.cli import main
from lit_dllm.core.optim import build_optimization
from lit_dllm.families.diffusion_gemma.model import BlockDiffusionGemma
from lit_dllm.families.mdlm.fast_sampler import fast_generate
from lit_dllm.hub.hf import load_causal_lm
from lit_dllm.testing import TINY_LLAMA

from .families.dflash import test_dflash as dflash_tests
from .families.diffusion_gemma import test_diffusion_gemma as gemma_tests
from .core.test_resume_and_errors import RecordLosses, data
from .core.test_training_step import collate, make_examples, make_module
from .test_compile import backend, tiny  # noqa: F401  (backend: a fixture)
from .test_compile import fit as fit_compiled
from .test_parallel import (
    STEPS,
    TOLERANCE,
    _gloo_group,
    _spawn,
    one_thread,
    make_optimizer,
    relative_differences,
    train,
)
from .test_parallel import make_module as make_moe_module
from .test_real_configs import CONFIGS, FIT, stand_in  # noqa: F401  (stand_in: a fixture)
from .test_throughput import tiny_llama_flops

LORA = {"r": 4, "lora_alpha": 8}


@pytest.fixture(autouse=True)
def tiny_matmuls_on_one_thread():
    """LoRA adds many tiny matmuls: on a busy 2-core machine more threads wait for each other."""
    with one_thread():
        yield


def adapted(cls, lora=LORA, **kwargs):
    """A tiny module of family ``cls`` with LoRA (its model built), and a training batch for it."""
    if cls is BlockDiffusionGemmaModule:
        return gemma_tests.gemma(lora=lora, **kwargs), gemma_tests.batch(gemma_tests.data())
    return make_module(cls, lora=lora, **kwargs), {**collate(make_examples()), "epoch": 0}

FAMILIES = [MDLMModule, HybridMDLMModule, CausalLMModule, BlockDiffusionGemmaModule]


def sgd_steps(module, batch, steps: int = 2) -> torch.optim.Optimizer:
    """``steps`` plain SGD steps of the module's own loss, with the optimizer its ``configure_optimizers`` builds."""
    optimizer = build_optimization(module.model, steps, lr=0.5, weight_decay=0.0, betas=(0.9, 0.95), warmup=0,
                                   min_lr_ratio=1.0, optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5))
    optimizer = optimizer["optimizer"]
    module.train()
    for epoch in range(steps):
        prepared = module.prepare_batch(batch, module.noise_keys(batch, epoch))
        counts = {k: v.float().clamp_min(1.0) for k, v in module.token_counts(batch, prepared).items()}
        module.compute_loss(batch, prepared, counts).output.total_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def adapter_names(module) -> set[str]:
    return {name for name, _ in module.named_parameters() if ".lora_" in name}


# ------------------------------------------------------------------------------------------ training the adapters
@pytest.mark.parametrize("cls", FAMILIES, ids=lambda c: c.__name__)
def test_only_the_adapters_train_and_the_base_stays_bit_for_bit(cls):
    module, batch = adapted(cls)
    names = adapter_names(module)
    assert names and {n for n, p in module.named_parameters() if p.requires_grad} == names
    base = {n: p.detach().clone() for n, p in module.named_parameters() if n not in names}
    adapters = {n: p.detach().clone() for n, p in module.named_parameters() if n in names}
    optimizer = sgd_steps(module, batch)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in module.named_parameters() if n in names}
    params = dict(module.named_parameters())
    assert all(torch.equal(params[n], value) for n, value in base.items())
    assert any(not torch.equal(params[n], value) for n, value in adapters.items() if ".lora_B." in n)


def test_gemma_encoder_and_decoder_share_one_adapter_per_shared_weight():
    module, _ = adapted(BlockDiffusionGemmaModule)
    hf = module.model.hf.model
    for encoder, decoder in zip(hf.encoder.language_model.layers, hf.decoder.layers):
        assert encoder.self_attn.q_proj is decoder.self_attn.q_proj and encoder.mlp.down_proj is decoder.mlp.down_proj
        assert not any(".lora_" in name for name, _ in encoder.experts.named_parameters())  # experts: not by default


def test_training_flops_count_the_frozen_base_with_its_input_gradients():
    """By hand: TINY_LLAMA's 21,792 matmul parameters (tests/test_throughput.py) now frozen, at 4 FLOPs a token
    (forward and input gradients), plus r 4 adapters on its 14 projections, 4 x (d_in + d_out) each: 4,096 at 6."""
    module = MDLMModule(vocab_size=100, mask_token_id=99, backbone=CausalBackbone(model_config=TINY_LLAMA), lora=LORA)
    module.configure_model()
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == 4096
    batch = {"input_ids": torch.zeros(3, 16, dtype=torch.long)}
    assert module.training_flops(batch) == tiny_llama_flops(3, 16, 100) + (-2 * 21_792 + 6 * 4096) * 3 * 16 == 5_953_536


@pytest.mark.parametrize("backend", ["aot_eager"], indirect=True)
def test_compiled_and_checkpointed_blocks_with_lora_equal_eager(backend):
    _, eager, _ = fit_compiled(tiny(lora=LORA), backend, steps=2, parallelism=Parallelism(compile=False))
    _, compiled, _ = fit_compiled(tiny(lora=LORA), backend, steps=2,
                                  parallelism=Parallelism(compile=True, activation_checkpointing=True))
    assert backend.compiles > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ checkpoints and resume
@pytest.fixture
def base_folder(tmp_path) -> Path:
    """A pretrained tiny Llama (the data module's vocabulary) saved as a transformers folder."""
    torch.manual_seed(1)
    folder = tmp_path / "base"
    load_causal_lm(None, {**TINY_LLAMA, "vocab_size": data().vocab_size}).save_pretrained(folder)
    return folder


def fit_lora(root: Path, base: Path, callback, ckpt_path=None) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=7, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=root, callbacks=[callback,
        L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1)],
    )
    dm = data()
    torch.manual_seed(0)
    module = MDLMModule(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                        eos_token_id=dm.eos_token_id, backbone=CausalBackbone(model=str(base)),
                        generation=LLaDAGeneration(val_generate_batches=0), optimization=Optimization(lr=1e-2),
                        lora=LORA)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def test_checkpoints_hold_the_adapters_only_and_resume_bit_for_bit(tmp_path, base_folder):
    whole = RecordLosses()
    trainer = fit_lora(tmp_path / "whole", base_folder, whole)
    first = RecordLosses(stop_at=3)
    fit_lora(tmp_path / "parts", base_folder, first)
    rest = RecordLosses()
    fit_lora(tmp_path / "parts", base_folder, rest, ckpt_path=str(tmp_path / "parts" / "last.ckpt"))
    assert first.losses + rest.losses == whole.losses
    saved = torch.load(tmp_path / "whole" / "last.ckpt", weights_only=False)["state_dict"]
    assert set(saved) == adapter_names(trainer.lightning_module)  # no copy of the base
    reloaded = MDLMModule.load_from_checkpoint(tmp_path / "whole" / "last.ckpt")
    for name, value in trainer.lightning_module.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


# ---------------------------------------------------------------------------------------------------- exports
def served_logits(cls, hf, module, batch) -> torch.Tensor:
    """The logits of transformers model ``hf`` as ``module`` computes them (Gemma: the canvas denoiser's)."""
    if cls is BlockDiffusionGemmaModule:
        module.eval()
        prepared = gemma_tests.prepare(module, batch)
        served = BlockDiffusionGemma(hf.eval())
        hidden, _ = served.denoise(batch["input_ids"], prepared["encoder_masks"], prepared["canvas_ids"],
                                   prepared["decoder_masks"], prepared["decoder_positions"])
        return served.logits(hidden)
    return hf(input_ids=batch["input_ids"]).logits


@pytest.mark.parametrize("cls", [MDLMModule, CausalLMModule, BlockDiffusionGemmaModule], ids=lambda c: c.__name__)
def test_the_merged_export_is_a_plain_checkpoint_with_the_adapted_logits(tmp_path, cls):
    module, batch = adapted(cls)
    sgd_steps(module, batch)
    module.save_pretrained(tmp_path, merge=True)
    loader = DiffusionGemmaForBlockDiffusion if cls is BlockDiffusionGemmaModule else AutoModelForCausalLM
    merged = loader.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert not any("lora" in name or "base_layer" in name for name in merged.state_dict())
    module.eval()
    with torch.no_grad():
        expected, got = served_logits(cls, module.model.hf, module, batch), served_logits(cls, merged, module, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_gemma_experts_are_includable_and_merge(tmp_path):
    experts = ["experts.gate_up_proj", "experts.down_proj"]
    module, batch = adapted(BlockDiffusionGemmaModule, lora={**LORA, "target_parameters": experts})
    hf = module.model.hf.model
    assert hf.encoder.language_model.layers[0].experts is hf.decoder.layers[0].experts  # one adapter, shared
    assert any(".experts." in name and ".lora_B." in name for name in adapter_names(module))
    sgd_steps(module, batch)
    module.save_pretrained(tmp_path)
    merged = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path, attn_implementation="eager")
    module.eval()
    with torch.no_grad():
        expected = served_logits(BlockDiffusionGemmaModule, module.model.hf, module, batch)
        got = served_logits(BlockDiffusionGemmaModule, merged, module, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)  # merged experts: one more rounding per weight


@pytest.mark.parametrize("cls", [MDLMModule, CausalLMModule], ids=lambda c: c.__name__)
def test_the_adapter_export_reloads_with_peft(tmp_path, base_folder, cls):
    from peft import PeftModel

    dm = data()
    module = cls(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                 eos_token_id=dm.eos_token_id, backbone={"model": str(base_folder)}, lora=LORA)
    module.configure_model()
    batch = {**collate(make_examples()), "epoch": 0}
    sgd_steps(module, batch)
    module.save_pretrained(tmp_path / "adapter", merge=False)
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    base = AutoModelForCausalLM.from_pretrained(base_folder)
    base.config.is_causal = cls is not MDLMModule  # MDLM runs its base bidirectionally (its merged export records it)
    served = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=batch["input_ids"]).logits, module.model(batch["input_ids"]),
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("sampler", ["llada", "fast"])
@pytest.mark.parametrize("cls", [MDLMModule, HybridMDLMModule], ids=lambda c: c.__name__)
def test_mdlm_exports_reload_with_auto_model_and_answer_as_the_module(tmp_path, cls, sampler):
    dm = data()
    torch.manual_seed(0)
    module = cls(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                 eos_token_id=dm.eos_token_id, backbone={"model_config": TINY_LLAMA},
                 generation={"gen_length": 8, "gen_block_length": 4, "gen_steps": 4, "sampler": sampler,
                             "gen_threshold": 0.2, "gen_cache": "dual" if sampler == "fast" else "prefix"})
    module.tokenizer = dm.tokenizer
    module.save_pretrained(tmp_path)
    hf, tokenizer = AutoModelForCausalLM.from_pretrained(tmp_path).eval(), AutoTokenizer.from_pretrained(tmp_path)
    config = hf.config
    assert config.is_causal is False and config.mask_token_id == tokenizer.mask_token_id == dm.mask_token_id
    assert config.dllm_sampler == sampler and config.dllm_sampling["gen_length"] == 8
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("rev 4821=", "rev 17=")]
    sample = fast_generate if sampler == "fast" else llada_generate
    served = sample(hf, prompts, **config.dllm_sampling)
    expected = module.generate_ids(prompts)
    assert all(map(torch.equal, served, expected)) and [len(a) for a in served] == [len(a) for a in expected]


# ------------------------------------------------------------------------------------------------ FSDP2 + LoRA
def _lora_worker(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 and FSDP2 + EP=2 with LoRA (tiny Qwen3-MoE MDLM); rank 0 saves the histories; both export merged."""
    from lit_dllm.parallel import parallelize
    from lit_dllm.strategies import init_meshes

    results = {}
    with _gloo_group(rank, world, port):
        for name, ep in (("fsdp2", 1), ("fsdp2+ep2", 2)):
            meshes = init_meshes(world, ep, "cpu")
            module = make_moe_module(lora=LORA)
            parallelize(module.model, meshes)
            results[name] = train(module, make_optimizer(module), range(STEPS), meshes, rank)
            module._trainer = SimpleNamespace(strategy=meshes)
            module.save_pretrained(Path(out) / name, merge=True)  # collective: gathered to rank 0
        if rank == 0:
            torch.save(results, Path(out) / "results.pt")


def test_fsdp2_with_lora_follows_one_process_and_exports_from_the_shards(tmp_path):
    module = make_moe_module(lora=LORA)
    reference = train(module, make_optimizer(module), range(STEPS))
    module.save_pretrained(tmp_path / "single", merge=True)
    results = _spawn(_lora_worker, 2, tmp_path)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "single").state_dict()
    for run, history in results.items():
        assert max(relative_differences(history, reference)) < TOLERANCE, run
        state = AutoModelForCausalLM.from_pretrained(tmp_path / run).state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=f"{run}: {name}")


# ------------------------------------------------------------------------------------------------------ bad input
def test_bad_lora_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"target_modules=\{'qkv'\}.*match nothing.*'q_proj'"):
        make_module(lora={"target_modules": ["qkv"]})
    with pytest.raises(ValueError, match="lora=.*'rank'.*not a valid LoRA setting.*lora_alpha"):
        make_module(lora={"rank": 4})
    with pytest.raises(ValueError, match="merge=False writes LoRA adapters.*no lora"):
        make_module().save_pretrained("unused", merge=False)


def test_lora_on_the_frozen_dflash_target_is_refused():
    with pytest.raises(ValueError, match=r"lora would adapt model\.target, which is frozen.*Drop lora"):
        dflash_tests.dflash(lora=LORA)


# ------------------------------------------------------------------------------------------------------ configs
def test_the_lora_recipe_layers_on_the_mdlm_recipe(stand_in):
    cli = main(["fit", "--config", str(CONFIGS / "mdlm_smollm2_gsm8k.yaml"), "--config",
                str(CONFIGS / "mdlm_smollm2_gsm8k_lora.yaml"), *FIT])
    module = cli.model
    assert module.hparams.lora == {"r": 32, "lora_alpha": 64, "lora_dropout": 0.05} and cli.trainer.global_step == 2
    assert {n for n, p in module.named_parameters() if p.requires_grad} == adapter_names(module)
    saved = torch.load(next(stand_in.rglob("mdlm_smollm2_gsm8k_lora/checkpoints/last.ckpt")), weights_only=False)
    assert set(saved["state_dict"]) == adapter_names(module)


def test_the_llada_lora_overlay_parses(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "llada_8b_sft.yaml"), "--config",
              str(CONFIGS / "llada_8b_sft_lora.yaml"), "--print_config=skip_null", "--data.init_args.tokenizer.name=null"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "lora:" in printed and "r: 16" in printed
    strategy = yaml.safe_load(printed)["trainer"]["strategy"]  # one device, in place of the base's FSDP2
    assert strategy["class_path"] == "lit_dllm.SingleDeviceStrategy"
    assert strategy["init_args"]["parallelism"]["activation_checkpointing"] is True


def test_a_lora_checkpoint_loaded_without_lora_names_the_adapters_and_the_fix():
    """Loaded into a module with ``lora=None``, the adapters' weights would be unexpected keys: say what they are."""
    state = {"state_dict": adapted(MDLMModule)[0].state_dict()}
    plain, _ = adapted(MDLMModule, lora=None)
    with pytest.raises(ValueError, match=r"holds LoRA adapters \(\d+ tensors, e\.g\. .*lora_A.* lora=None: load it "):
        plain.on_load_checkpoint(state)
