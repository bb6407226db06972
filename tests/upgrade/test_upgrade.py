"""Checkpoints and spellings of earlier versions stay usable (:mod:`lit_dllm.upgrade`; this folder goes with it in 0.3).

``fixtures/*_v0.ckpt`` and ``*_v1.ckpt`` beside this file were written by two earlier versions (``fixtures/
make_checkpoints.py``: one CLI fit step of each module class). v0 predates the ``lit_dllm/core`` +
``lit_dllm/families`` layout and the settings groups: its MDLM, hybrid, causal-LM and DiffusionGemma configs named
their class by its public name (``lit_dllm.MDLMModule``), DFlash's by ``lit_dllm.modules.dflash.DFlashModule``, a
module that no longer exists (:data:`lit_dllm.upgrade.MOVED_MODULES` maps it). v1 predates the strategy owning how
to run: it holds run settings (``compile``, ``fsdp_*``...), flat optimisation and tokenizer settings, DFlash's flat
target. Both hold the data module's settings flat (before its groups).
"""

import importlib
import json
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml

import lit_dllm
from lit_dllm import DLLMDataModule, HybridMDLMModule, LLaDAGeneration, MDLMModule
from lit_dllm.cli import main
from lit_dllm.settings import BuiltinTask, CausalBackbone, Collation, DataSource, Loader, Tokenizer, settings_groups
from lit_dllm.testing import TINY_LLAMA
from lit_dllm.upgrade import FLAT_DATA_SETTINGS, MOVED_MODULES, current_class_path
from tests.data.test_datamodule import gpt2_dir  # noqa: F401  (a fixture)
from tests.upgrade.fixtures.make_checkpoints import COMMON, GROUPED, RUNS, VERSIONS, spelled

pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated; pass them grouped:DeprecationWarning")
"""The flat spellings, an error everywhere else (pyproject.toml's filterwarnings), are this file's subject: the tests
that check their warning say so with ``pytest.warns``."""

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CLASSES = {"mdlm": lit_dllm.MDLMModule, "hybrid": lit_dllm.HybridMDLMModule, "causal_lm": lit_dllm.CausalLMModule,
           "diffusion_gemma": lit_dllm.BlockDiffusionGemmaModule, "dflash": lit_dllm.DFlashModule}
MOVED = {"tokenizer": "tokenizer_settings.name", "mask_token": "tokenizer_settings.mask_token",
         "tokenizer_gguf_file": "tokenizer_settings.gguf_file", "trust_remote_code": "tokenizer_settings.trust_remote_code"}
TARGET = {"target": "target.model", "target_config": "target.model_config", "target_gguf_file": "target.gguf_file",
          "torch_dtype": "target.torch_dtype"}
"""Where a setting of the earlier layouts went, by hand; :data:`TARGET`: DFlash's (its ``torch_dtype`` was its
target's)."""
DROPPED = {"compile", "experts_implementation", "fp8", "fsdp_reshard_after_forward", "fsdp_defer_gradient_sync",
           "fsdp_prefetch_next_step", "fsdp_reduce_dtype", "activation_checkpointing"}
"""Run settings: the strategy's now, not kept by the module."""
DATA_GROUPED = {f"--data.init_args.{old}": f"--data.init_args.{group}.{field}"
                for old, (group, field) in FLAT_DATA_SETTINGS.items()}
"""The data module's flags of :data:`~tests.upgrade.fixtures.make_checkpoints.COMMON`, as its groups spell them now."""


def saved(name: str, version: str = "v0") -> dict:
    return torch.load(FIXTURES / f"{name}_{version}.ckpt", map_location="cpu", weights_only=True)


def restored(module, key: str):
    """``module``'s hyper-parameter ``key`` (``group.field`` for a group's)."""
    group, _, field = key.rpartition(".")
    return module.hparams[group][field] if group else module.hparams[key]


def assert_restored(module, checkpoint: dict) -> None:
    """Every setting of the checkpoint, wherever it lives now (its group's field, :data:`MOVED`), or gone when it is a
    run setting; its weights and tokenizer; all in ``module``."""
    groups = settings_groups(type(module))
    flat = {}
    for key, value in checkpoint["hyper_parameters"].items():
        if isinstance(value, dict) and key in groups:  # a group already (v1): field by field
            flat.update({f"{key}.{field}": item for field, item in value.items()})
        elif not key.startswith("_"):  # _class_path, _instantiator: LightningCLI's records, not module settings
            flat[key] = value
    for key, value in flat.items():
        if key.rpartition(".")[2] in DROPPED:
            assert key.rpartition(".")[2] not in module.hparams.get(key.rpartition(".")[0], module.hparams), key
            continue
        moved = {**MOVED, **(TARGET if "target" in groups else {})}
        where = moved.get(key) or next((f"{name}.{key}" for name in groups if key in module.hparams[name]), key)
        restored_value = restored(module, where)
        value = [] if key == "frozen_modules" and value is None else value  # None meant none
        assert (list(restored_value) if isinstance(restored_value, tuple) else restored_value) == value, key
    state = module.state_dict()
    assert checkpoint["state_dict"]
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(state[key], value), key
    assert len(module.tokenizer) == checkpoint["hyper_parameters"]["vocab_size"]


def test_the_fixtures_record_the_old_layout():
    assert saved("dflash")["hyper_parameters"]["_class_path"] == "lit_dllm.modules.dflash.DFlashModule"
    assert saved("mdlm")["hyper_parameters"]["_class_path"] == "lit_dllm.MDLMModule"
    assert saved("diffusion_gemma")["hyper_parameters"]["_class_path"] == "lit_dllm.BlockDiffusionGemmaModule"
    assert {path.name for path in FIXTURES.glob("*.ckpt")} == {f"{n}_{v}.ckpt" for n in CLASSES for v in VERSIONS}
    assert set(CLASSES) == set(RUNS)
    assert saved("mdlm", "v1")["hyper_parameters"]["compile"] is None  # v1: run settings on the module
    assert saved("dflash", "v1")["hyper_parameters"]["target_config"] is not None
    assert all(path.stat().st_size < 2**20 for path in FIXTURES.glob("*.ckpt"))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", CLASSES)
def test_load_from_checkpoint_restores_hparams_weights_and_tokenizer(name, version):
    module = CLASSES[name].load_from_checkpoint(FIXTURES / f"{name}_{version}.ckpt")
    assert type(module) is CLASSES[name]
    assert_restored(module, saved(name, version))
    assert not DROPPED & set(module.hparams)


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


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["dflash", "mdlm", "diffusion_gemma"])
def test_the_cli_resumes_an_old_checkpoint(name, version, tmp_path):
    from lit_dllm.cli import main

    config, *args = RUNS[name]
    args = spelled(args, GROUPED)  # the run's own settings, in today's spelling; DFlash's target as one group
    target = {"model": None, "model_config": TINY_LLAMA}
    args = [f"--model.init_args.target={json.dumps(target)}" if "target" in arg else arg for arg in args
            if not arg.startswith("--model.init_args.target_config")]
    steps = spelled([arg for arg in COMMON if not arg.startswith("--trainer.max_steps")], DATA_GROUPED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(["fit", "--config", config, *args, *steps, "--trainer.max_steps=2",
                    f"--trainer.logger.init_args.save_dir={tmp_path}", f"--ckpt_path={FIXTURES / f'{name}_{version}.ckpt'}"])
    assert not [str(w.message) for w in caught if "was trained as" in str(w.message)]
    assert cli.trainer.global_step == 2  # the checkpoint's step 1, then one more
    assert type(cli.model) is CLASSES[name]
    hparams = saved(name, version)["hyper_parameters"]
    assert cli.model.generation.gen_length == (hparams["generation"] if version != "v0" else hparams)["gen_length"]


@pytest.mark.parametrize("version", VERSIONS)
def test_an_old_checkpoint_rebuilds_its_data_module_in_the_groups(version):
    """The data module's flat hyper-parameters go into its groups as read, without a warning (the checkpoint's layout,
    not the user's spelling)."""
    flat = saved("diffusion_gemma", version)["datamodule_hyper_parameters"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        data = lit_dllm.DLLMDataModule.load_from_checkpoint(FIXTURES / f"diffusion_gemma_{version}.ckpt")
    for old, (group, field) in FLAT_DATA_SETTINGS.items():
        value = getattr(data.tokenizer_settings if group == "tokenizer" else getattr(data, group), field)
        assert value == flat[old], old
    assert (data.max_seq_len, data.seed) == (flat["max_seq_len"], flat["seed"])


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


# ---------------------------------------------------------------------------- earlier spellings in Python and configs


def test_the_earlier_flat_spelling_still_works_and_warns_with_the_grouped_one(tmp_path, gpt2_dir):
    """Every flat argument of the earlier signature (a checkpoint of that layout holds them) is moved into its group."""
    with pytest.warns(DeprecationWarning, match=r"batch_size -> data.init_args.loader.batch_size.*"
                                                r"task_num_train -> data.init_args.task.num_train") as record:
        flat = DLLMDataModule("task:add", batch_size=4, task_num_train=32, task_num_val=8, val_split=None,
                              tokenizer=None, mask_token="<|mask|>", pad_block_size=2, max_seq_len=16,
                              cache_dir=str(tmp_path))
    assert record[0].filename == __file__  # the warning points at the caller
    grouped = DLLMDataModule(DataSource(path="task:add", cache_dir=str(tmp_path)), Tokenizer(mask_token="<|mask|>"),
                             collation=Collation(pad_block_size=2), loader=Loader(batch_size=4),
                             task=BuiltinTask(num_train=32, num_val=8), max_seq_len=16)
    assert dict(flat.hparams) == dict(grouped.hparams)
    with pytest.warns(DeprecationWarning, match=r"tokenizer -> data.init_args.tokenizer.name"):
        named = DLLMDataModule(tokenizer=gpt2_dir, tokenizer_gguf_file=None)  # a string: the tokenizer's name
    assert named.tokenizer_settings == Tokenizer(name=gpt2_dir) and named.vocab_size == 50259


def test_flat_settings_move_into_their_groups_with_a_deprecation_warning():
    """The signatures before the settings groups: ``MDLMModule(..., model_config=..., gen_length=...)``."""
    expected = (r"gen_length, gen_block_length, sampler: flat settings are deprecated; pass them grouped, as "
                r"generation=LLaDAGeneration\(gen_length=..., gen_block_length=..., sampler=...\) \(a config: "
                r"model.init_args.generation.gen_length\)")
    with pytest.warns(DeprecationWarning, match=expected):
        flat = MDLMModule(40, 39, model_config=TINY_LLAMA, gen_length=8, gen_block_length=4, sampler="fast")
    assert flat.generation == LLaDAGeneration(gen_length=8, gen_block_length=4, sampler="fast")
    assert flat.hparams == MDLMModule(40, 39, backbone=CausalBackbone(model_config=TINY_LLAMA), generation=LLaDAGeneration(
        gen_length=8, gen_block_length=4, sampler="fast")).hparams
    assert flat.hparams.backbone == asdict(CausalBackbone(model_config=TINY_LLAMA))
    assert not {"gen_length", "model_config", "sampler"} & set(flat.hparams)
    grouped = MDLMModule(40, 39, model_config=TINY_LLAMA, generation=LLaDAGeneration(gen_length=8), gen_block_length=4)  # a flat setting goes over its group's
    assert (grouped.generation.gen_length, grouped.generation.gen_block_length) == (8, 4)
    # a subclass that passes its keyword arguments on: the hyper-parameters (and the initial ones, which loggers
    # write) hold the groups as dicts and no flat leftover
    hybrid = HybridMDLMModule(40, 39, backbone=CausalBackbone(model_config=TINY_LLAMA), gen_length=8, alpha=0.5)
    for hparams in (hybrid.hparams, hybrid.hparams_initial):
        assert hparams["backbone"] == flat.hparams.backbone and hparams["generation"]["gen_length"] == 8
        assert "gen_length" not in hparams and hparams["alpha"] == 0.5


@pytest.mark.parametrize("kwargs", [{"gen_length": 0}, {"gen_length": 10, "gen_block_length": 4},
                                    {"remasking": "greedy"}, {"temperature": -0.5}])
def test_bad_flat_settings_fail_as_their_group_does(kwargs):
    """The flat spelling runs its group's checks (tests/core/test_arguments.py has the grouped spelling's)."""
    with pytest.raises(ValueError) as grouped:
        MDLMModule(40, 39, backbone=CausalBackbone(model_config=TINY_LLAMA), generation=LLaDAGeneration(**kwargs))
    with pytest.raises(ValueError) as flat, pytest.warns(DeprecationWarning, match="grouped"):
        MDLMModule(40, 39, model_config=TINY_LLAMA, **kwargs)
    assert str(flat.value) == str(grouped.value)


def test_every_flat_setting_reaches_its_group_and_the_warning_points_at_the_caller():
    """One call (``TokenLossModule``'s) moves each family's flat settings, its bases' too, into the group that holds
    them; the warning points here, not into lit_dllm, through a subclass's constructor too."""
    with pytest.warns(DeprecationWarning) as record:
        module = lit_dllm.DFlashModule(40, mask_token_id=39, model_config=TINY_LLAMA, val_temperature=0.5, lr=1e-2,
                                       weight_decay=0.0, tokenizer="gpt2", mask_token="<|mask|>")
    assert (module.target.model_config, module.generation.val_temperature) == (TINY_LLAMA, 0.5)
    assert (module.optimization.lr, module.optimization.weight_decay) == (1e-2, 0.0)
    assert module.tokenizer_settings == Tokenizer(name="gpt2", mask_token="<|mask|>")
    assert module.hparams.tokenizer_settings == asdict(module.tokenizer_settings)
    assert module.hparams.optimization["lr"] == 1e-2 and "lr" not in module.hparams
    messages = {str(warning.message) for warning in record}
    assert ("tokenizer, mask_token: flat settings are deprecated; pass them grouped, as tokenizer_settings=Tokenizer("
            "name=..., mask_token=...) (a config: data.init_args.tokenizer.name).") in messages
    assert ("lr, weight_decay: flat settings are deprecated; pass them grouped, as optimization=Optimization(lr=..., "
            "weight_decay=...) (a config: model.init_args.optimization.lr).") in messages
    assert {warning.filename for warning in record} == {__file__}
    with pytest.warns(DeprecationWarning, match=r"gen_length: .* as generation=LLaDAGeneration\(gen") as record:
        HybridMDLMModule(40, 39, backbone=CausalBackbone(model_config=TINY_LLAMA), gen_length=8)
    assert record[0].filename == __file__


def test_unknown_and_run_settings_are_refused_naming_the_class_or_the_strategy():
    backbone = CausalBackbone(model_config=TINY_LLAMA)
    with pytest.raises(TypeError, match=r"HybridMDLMModule got unexpected settings \['gen_lenght'\]: see its doc"):
        HybridMDLMModule(40, 39, backbone=backbone, gen_lenght=8)
    with pytest.raises(TypeError, match=r"fp8 now belong.*trainer\.strategy\.init_args\.parallelism\.fp8"):
        MDLMModule(40, 39, backbone=backbone, fp8="rowwise")
    with pytest.raises(TypeError, match=r"DiffuGRPOModule got unexpected settings \['kl_beta'\]"):  # rl: never flat
        lit_dllm.DiffuGRPOModule(40, 39, backbone=backbone, kl_beta=0.1)


def test_settings_written_flat_get_their_grouped_spelling(tmp_path, capsys):
    """A config or flag from before the settings groups stops with the grouped spelling of each flat name."""
    config = yaml.safe_load(Path("configs/mdlm_tiny.yaml").read_text())
    init = config["model"]["init_args"]
    init.update(init.pop("generation"), model_config=init.pop("backbone")["model_config"])
    (tmp_path / "flat.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tmp_path / "flat.yaml"), "--model.init_args.torch_dtype=float32"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert ("write generation.gen_canvas_multiple, generation.gen_length, backbone.model_config, backbone.torch_dtype, "
            "generation.val_generate_batches (in a config: model.init_args.generation: {gen_canvas_multiple: ...}) "
            "instead of gen_canvas_multiple, gen_length, model_config, torch_dtype, val_generate_batches" in err)


def test_data_settings_written_flat_get_their_grouped_spelling(tmp_path, capsys):
    """A config or flag from before the data module's groups stops (exit 2) with the grouped spelling of each."""
    config = yaml.safe_load(Path("configs/mdlm_tiny.yaml").read_text())
    init = config["data"]["init_args"]
    init.update(data=init.pop("source")["path"], batch_size=init.pop("loader")["batch_size"])
    (tmp_path / "flat.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tmp_path / "flat.yaml"), "--data.init_args.tokenizer=gpt2",
              "--data.init_args.tokenizer.mask_token=<|mask|>"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert ("The data module's settings now come in groups: write loader.batch_size, source.path, tokenizer.name (in a "
            "config: data.init_args.loader: {batch_size: ...}) instead of batch_size, data, tokenizer" in err)


def test_run_settings_on_the_model_stop_a_config_with_their_place_on_the_strategy(tmp_path, capsys):
    config = {"model": {"init_args": {"compile": False, "fsdp_reduce_dtype": "bfloat16",
                                      "backbone": {"activation_checkpointing": True}}}}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/mdlm_tiny.yaml", "--config", str(tmp_path / "old.yaml")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    for name in ("activation_checkpointing", "compile", "fsdp_reduce_dtype"):
        assert f"trainer.strategy.init_args.parallelism.{name}" in err
    assert "lit_dllm.SingleDeviceStrategy" in err


def test_run_settings_given_to_a_module_in_python_name_their_place():
    with pytest.raises(TypeError, match=r"compile now belong.* trainer\.strategy\.init_args\.parallelism\.compile"):
        MDLMModule(40, 39, backbone=CausalBackbone(model_config=TINY_LLAMA), compile=False)
