"""Checkpoints of the version before the ``lit_dllm/core`` + ``lit_dllm/families`` layout stay loadable.

``tests/fixtures/*_v0.ckpt`` were written by that version (``tests/fixtures/make_checkpoints.py``: one CLI fit step
of each module class). The MDLM, hybrid, causal-LM and DiffusionGemma configs named their class by its public name
(``lit_dllm.MDLMModule``); DFlash's named ``lit_dllm.modules.dflash.DFlashModule``, a module that no longer exists,
which :data:`lit_dllm.checkpointing.MOVED_MODULES` maps to its new place.
"""

import importlib
import warnings
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import lit_dllm
from lit_dllm.core.upgrade import MOVED_MODULES, current_class_path
from lit_dllm.settings import settings_groups
from tests.fixtures.make_checkpoints import COMMON, RUNS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GROUPED_FLAGS = {"--model.init_args.model_config": "--model.init_args.backbone.model_config",
                 "--model.init_args.gen_length": "--model.init_args.generation.gen_length"}
CLASSES = {"mdlm": lit_dllm.MDLMModule, "hybrid": lit_dllm.HybridMDLMModule, "causal_lm": lit_dllm.CausalLMModule,
           "diffusion_gemma": lit_dllm.BlockDiffusionGemmaModule, "dflash": lit_dllm.DFlashModule}


def saved(name: str) -> dict:
    return torch.load(FIXTURES / f"{name}_v0.ckpt", map_location="cpu", weights_only=True)


def assert_restored(module, checkpoint: dict) -> None:
    """The checkpoint's hyper-parameters (flat: those of a settings group now in it), weights and tokenizer, all in
    ``module``."""
    groups = settings_groups(type(module))
    for key, value in checkpoint["hyper_parameters"].items():
        if not key.startswith("_"):  # _class_path, _instantiator: LightningCLI's records, not module settings
            group = next((module.hparams[name] for name in groups if key in module.hparams[name]), module.hparams)
            restored = group[key]
            assert (list(restored) if isinstance(restored, tuple) else restored) == value, key  # betas: a tuple
    declared = {field.name for kind in groups.values() for field in fields(kind)}
    assert not declared & set(module.hparams), "flat settings left beside their groups"
    state = module.state_dict()
    assert checkpoint["state_dict"]
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(state[key], value), key
    assert len(module.tokenizer) == checkpoint["hyper_parameters"]["vocab_size"]


def test_the_fixtures_record_the_old_layout():
    assert saved("dflash")["hyper_parameters"]["_class_path"] == "lit_dllm.modules.dflash.DFlashModule"
    assert saved("mdlm")["hyper_parameters"]["_class_path"] == "lit_dllm.MDLMModule"
    assert saved("diffusion_gemma")["hyper_parameters"]["_class_path"] == "lit_dllm.BlockDiffusionGemmaModule"
    assert {path.name.removesuffix("_v0.ckpt") for path in FIXTURES.glob("*.ckpt")} == set(CLASSES) == set(RUNS)
    assert all(path.stat().st_size < 2**20 for path in FIXTURES.glob("*.ckpt"))


@pytest.mark.parametrize("name", CLASSES)
def test_load_from_checkpoint_restores_hparams_weights_and_tokenizer(name):
    module = CLASSES[name].load_from_checkpoint(FIXTURES / f"{name}_v0.ckpt")
    assert type(module) is CLASSES[name]
    assert_restored(module, saved(name))


def test_load_from_checkpoint_maps_an_old_module_path(tmp_path):
    """A run whose config named the class by its module (``lit_dllm.modules.diffusion_gemma.BlockDiffusionGemmaModule``,
    as DFlash's did) instead of the public name the fixture records."""
    checkpoint = saved("diffusion_gemma")
    checkpoint["hyper_parameters"]["_class_path"] = "lit_dllm.modules.diffusion_gemma.BlockDiffusionGemmaModule"
    torch.save(checkpoint, tmp_path / "old_path.ckpt")
    module = lit_dllm.BlockDiffusionGemmaModule.load_from_checkpoint(tmp_path / "old_path.ckpt")
    assert type(module) is lit_dllm.BlockDiffusionGemmaModule
    assert_restored(module, saved("diffusion_gemma"))


def test_load_from_checkpoint_stays_a_class_method():
    module = lit_dllm.MDLMModule.load_from_checkpoint(FIXTURES / "mdlm_v0.ckpt")
    with pytest.raises(TypeError, match="cannot be called on an instance"):
        module.load_from_checkpoint(FIXTURES / "mdlm_v0.ckpt")
    assert lit_dllm.MDLMModule.load_from_checkpoint.__doc__.startswith("Lightning's ``load_from_checkpoint``")


def test_the_moved_class_paths_resolve_and_the_old_modules_are_gone():
    assert current_class_path("lit_dllm.modules.dflash.DFlashModule") == "lit_dllm.families.dflash.module.DFlashModule"
    hybrid = current_class_path("lit_dllm.modules.mdlm.HybridMDLMModule")
    assert hybrid == "lit_dllm.families.mdlm.module.HybridMDLMModule"
    assert current_class_path("lit_dllm.MDLMModule") == "lit_dllm.MDLMModule"
    assert current_class_path("my_package.variants.MyModule") == "my_package.variants.MyModule"
    assert current_class_path(None) is None
    package = Path(lit_dllm.__file__).parent
    for old, new in MOVED_MODULES.items():
        importlib.import_module(new)
        assert not package.joinpath(*old.split(".")[1:]).with_suffix(".py").exists(), old  # no shim left behind
    assert not any((package / folder).exists() for folder in ("modules", "models", "sampling"))
    old_modules = {"mdlm": "mdlm", "hybrid": "mdlm", "causal_lm": "causal_lm", "diffusion_gemma": "diffusion_gemma",
                   "dflash": "dflash"}
    for name, cls in CLASSES.items():
        moved = current_class_path(f"lit_dllm.modules.{old_modules[name]}.{cls.__name__}")
        assert moved == f"{cls.__module__}.{cls.__qualname__}"


@pytest.mark.parametrize("name", ["dflash", "mdlm", "diffusion_gemma"])
def test_the_cli_resumes_an_old_checkpoint(name, tmp_path):
    from lit_dllm.cli import main

    config, *args = RUNS[name]
    args = [GROUPED_FLAGS.get(arg.partition("=")[0], arg.partition("=")[0]) + "=" + arg.partition("=")[2]
            for arg in args]  # the run's own settings, in today's spelling (model_config, gen_length: grouped)
    steps = [arg for arg in COMMON if not arg.startswith("--trainer.max_steps")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(["fit", "--config", config, *args, *steps, "--trainer.max_steps=2",
                    f"--trainer.logger.init_args.save_dir={tmp_path}", f"--ckpt_path={FIXTURES / f'{name}_v0.ckpt'}"])
    assert not [str(w.message) for w in caught if "was trained as" in str(w.message)]
    assert cli.trainer.global_step == 2  # the checkpoint's step 1, then one more
    assert type(cli.model) is CLASSES[name]
    assert cli.model.generation.gen_length == saved(name)["hyper_parameters"]["gen_length"]


def test_the_evaluation_harness_loads_an_old_checkpoint_by_its_recorded_class():
    pytest.importorskip("lm_eval")
    from lit_dllm.eval import load_module

    module = load_module(str(FIXTURES / "dflash_v0.ckpt"))
    assert type(module) is lit_dllm.DFlashModule
    assert_restored(module, saved("dflash"))
    named = load_module(str(FIXTURES / "mdlm_v0.ckpt"), module="lit_dllm.modules.mdlm.MDLMModule")  # an old path
    assert type(named) is lit_dllm.MDLMModule


@pytest.mark.parametrize("name", ["mdlm", "causal_lm"])
def test_a_flat_checkpoint_loads_its_settings_into_the_groups(name, tmp_path):
    """The fixtures hold settings flat, as every version before the settings groups saved them (the key set of a
    checkpoint written by that version's CLI, checked on 2026-11-27, equals the fixtures'). Lightning's CLI
    instantiator reads untyped keyword arguments as YAML: a flat ``"#### (\\S+)"`` would arrive as None (a comment)
    unless it is moved into its group first."""
    checkpoint = saved(name)
    flat = {"gen_length": 12, "temperature": 0.5, "answer_pattern": r"#### (\S+)", "val_generate_batches": 0}
    if name == "mdlm":
        flat.update(gen_block_length=4, sampler="fast", gen_cache="dual")
    checkpoint["hyper_parameters"].update(flat)
    torch.save(checkpoint, tmp_path / "flat.ckpt")
    module = CLASSES[name].load_from_checkpoint(tmp_path / "flat.ckpt")
    assert {key: getattr(module.generation, key) for key in flat} == flat
    assert module.hparams.backbone["model_config"] == checkpoint["hyper_parameters"]["model_config"]
    assert_restored(module, checkpoint)
