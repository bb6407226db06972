"""Every private name of another library that ``lit_dllm.compat`` uses, checked on the installed versions: a release
that moves one fails here, naming the compat function to fix, instead of lit_dllm breaking or going quiet."""

import inspect
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.distributed.expert_parallel import AllToAllEP, apply_expert_parallelism
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from lit_dllm import compat
from lit_dllm.cli import DLLMCLI
from lit_dllm.core.token_loss import TokenLossModule

from lit_dllm.testing import TINY_LLAMA, TINY_MOE


def fix(function) -> str:
    return f"the installed version changed this internal: update lit_dllm.compat.{function.__name__}"


def tiny(settings: dict, **kwargs):
    config = AutoConfig.for_model(**settings, vocab_size=64)
    return AutoModelForCausalLM.from_config(config, **kwargs)


def calls_in_order(function, *calls: str) -> bool:
    source = inspect.getsource(function)
    return all(call in source for call in calls) and sorted(calls, key=source.index) == list(calls)


# ----------------------------------------------------------------------------------------------------- Lightning
class Recorded(BoringModel):
    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_lightning_cli_records_the_module_class_in_the_hparams(tmp_path):
    path = f"{Recorded.__module__}.{Recorded.__qualname__}"
    cli = LightningCLI(BoringModel, subclass_mode_model=True, run=False, args=[f"--model={path}"],
                       trainer_defaults={"default_root_dir": str(tmp_path), "logger": False})
    assert cli.model.hparams.get(compat.CLASS_PATH_KEY) == path, "update lit_dllm.compat.CLASS_PATH_KEY"
    assert compat.INSTANTIATOR_KEY in cli.model.hparams, "update lit_dllm.compat.INSTANTIATOR_KEY"


def test_lightning_cli_merges_checkpoint_hparams_in_the_step_we_skip():
    assert calls_in_order(LightningCLI.__init__, "self.parse_arguments(", "self._parse_ckpt_path()",
                          "self.before_instantiate_classes()"), fix(compat.skip_checkpoint_hparams)
    assert DLLMCLI._parse_ckpt_path(None) is None and LightningCLI._parse_ckpt_path is not DLLMCLI._parse_ckpt_path


def test_model_checkpoint_saves_last_once_per_step(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    saved = []

    class SaveAtFirstStep(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 1:
                for _ in range(2):  # the second call finds this step saved
                    compat.save_last_checkpoint(checkpoint, trainer)
                    saved.append(Path(checkpoint.last_model_path).stat().st_mtime_ns)

    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[checkpoint, SaveAtFirstStep()])
    try:
        trainer.fit(BoringModel())
    except AttributeError as err:
        pytest.fail(f"{fix(compat.save_last_checkpoint)} ({err})")
    assert checkpoint.last_model_path == str(tmp_path / "last.ckpt") and saved[0] == saved[1]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1
    compat.save_last_checkpoint(checkpoint, trainer)  # a later step: saved again
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2


def test_lightning_load_from_checkpoint_is_a_classmethod_that_refuses_an_instance(tmp_path):
    descriptor = vars(L.LightningModule)["load_from_checkpoint"]
    assert type(descriptor).__name__ == "_restricted_classmethod_impl", fix(compat.lightning_classmethod)
    assert isinstance(descriptor, classmethod), fix(compat.lightning_classmethod)

    class Module(BoringModel):
        @compat.lightning_classmethod
        def load_from_checkpoint(cls, path):
            """Returns what it was called with."""
            return cls, path

    class Subclass(Module):
        pass

    assert type(vars(Module)["load_from_checkpoint"]) is type(descriptor), fix(compat.lightning_classmethod)
    assert type(vars(TokenLossModule)["load_from_checkpoint"]) is type(descriptor)  # lit_dllm's override uses it
    assert Module.load_from_checkpoint("a.ckpt") == (Module, "a.ckpt") and Subclass.load_from_checkpoint("b") == (
        Subclass, "b")
    assert Module.load_from_checkpoint.__doc__ == "Returns what it was called with."  # inspectable, as Lightning's
    with pytest.raises(TypeError) as lightning:  # Lightning's own, on an instance: refused before reading the file
        BoringModel().load_from_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(TypeError) as ours:
        Module().load_from_checkpoint("a.ckpt")
    assert "cannot be called on an instance" in str(lightning.value), fix(compat.lightning_classmethod)
    assert str(ours.value) == str(lightning.value).replace("BoringModel", "Module"), fix(compat.lightning_classmethod)


def test_lightning_reads_a_checkpoint_through_the_reader_we_wrap(tmp_path):
    checkpoint = {"state_dict": Recorded().state_dict(), "hyper_parameters": {"width": 2},
                  "pytorch-lightning_version": L.__version__}
    torch.save(checkpoint, tmp_path / "recorded.ckpt")
    read = []

    def convert(loaded: dict) -> dict:
        read.append(loaded)
        loaded["hyper_parameters"]["width"] = 3
        return loaded

    with compat.converting_checkpoints(convert):
        module = Recorded.load_from_checkpoint(tmp_path / "recorded.ckpt")
    assert len(read) == 1 and module.hparams.width == 3, fix(compat.converting_checkpoints)
    assert Recorded.load_from_checkpoint(tmp_path / "recorded.ckpt").hparams.width == 2  # unwrapped after


def test_model_parallel_strategy_builds_its_mesh_with_the_private_data_parallel_size():
    strategy = ModelParallelStrategy(data_parallel_size="auto")
    compat.set_data_parallel_size(strategy, 8)
    assert vars(strategy).get("_data_parallel_size") == 8, fix(compat.set_data_parallel_size)
    assert calls_in_order(ModelParallelStrategy.setup_environment, 'if self._data_parallel_size == "auto"',
                          "_setup_device_mesh("), fix(compat.set_data_parallel_size)


def test_model_parallel_strategy_reads_its_mesh_from_the_private_device_mesh():
    strategy = ModelParallelStrategy()
    strategy._lightning_module = BoringModel()
    mesh = object()
    compat.set_device_mesh(strategy, mesh)
    assert strategy.device_mesh is mesh and strategy.lightning_module._device_mesh is mesh, fix(compat.set_device_mesh)
    assert "self.device_mesh" in inspect.getsource(type(strategy).distributed_sampler_kwargs.fget), fix(
        compat.set_device_mesh)


# ---------------------------------------------------------------------------------------------------------- torch
@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_templated_ring_attention_is_sdpa_and_restores_torch_options(one_rank):
    """One rank's ring is one SDPA step: the output and gradients of ``F.scaled_dot_product_attention`` (float64 merges
    in float64), and torch's process-wide ring options are as they were after."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    options = ("enable_load_balance", "rotate_method", "convert_to_f32")
    before = [getattr(_cp_options, name) for name in options]
    g = torch.Generator().manual_seed(0)
    query, key, value, grad = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(4))
    forward, backward = compat.flash_attention_ops(cuda=False)
    out, logsumexp, *_ = compat.templated_ring_attention(one_rank, forward, query, key, value, True, dropout_p=0.0,
                                                         scale=None)
    grads = compat.templated_ring_attention_backward(one_rank, backward, grad, query, key, value, out, logsumexp, True,
                                                     dropout_p=0.0, scale=None)[:3]
    inputs = [t.clone().requires_grad_() for t in (query, key, value)]
    expected = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=True)
    expected.backward(grad)
    assert torch.allclose(out, expected, atol=1e-12), fix(compat.templated_ring_attention)
    assert all(torch.allclose(got, t.grad, atol=1e-12) for got, t in zip(grads, inputs)), \
        fix(compat.templated_ring_attention_backward)
    assert [getattr(_cp_options, name) for name in options] == before, fix(compat.templated_ring_attention)


def test_flatten_mesh_takes_two_dimensions_together(fake_world):
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    flat = compat.flatten_mesh(mesh, ("a", "b"), "a_b")
    assert flat.mesh_dim_names == ("a_b",) and flat.size() == 2, fix(compat.flatten_mesh)
    assert compat.flatten_mesh(mesh, ("a", "b"), "a_b") is flat, fix(compat.flatten_mesh)


def test_fsdp2_unit_hooks_are_the_state_methods_we_rewire(fake_world):
    unit = [nn.Linear(4, 4), nn.Linear(4, 4)]
    unit[1].weight = unit[0].weight  # tied, as in a tied stack
    fully_shard(unit, mesh=fake_world)
    state = unit[0]._get_fsdp_state()
    for name in ("_pre_forward", "_post_forward", "_pre_backward", "_pre_forward_hook_handle",
                 "_post_forward_hook_handle"):
        assert hasattr(state, name), f"FSDP2's state has no {name}: {fix(compat.hook_fsdp_unit_per_module)}"
    compat.hook_fsdp_unit_per_module(unit)
    for module in unit:  # one pre- and one post-forward hook of the unit's state each
        assert [hook.__func__ for hook in module._forward_pre_hooks.values()] == [type(state)._pre_forward]
        assert type(state)._post_forward in [getattr(hook, "__func__", None) for hook in module._forward_hooks.values()]
    state._pre_forward_hook_handle.remove()
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in unit)


def test_after_backward_runs_once_the_whole_backward_has_run():
    weight = nn.Parameter(torch.ones(2))
    order = []
    weight.register_post_accumulate_grad_hook(lambda _: order.append("gradient accumulated"))
    hidden = weight * 2
    hidden.register_hook(lambda grad: compat.after_backward(lambda: order.append("callback")))
    (hidden * 3).sum().backward()
    assert order == ["gradient accumulated", "callback"], fix(compat.after_backward)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_optimizers_skip_a_step_on_found_inf(fused):
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=fused or None)
    assert compat.can_skip_step(optimizer) == fused, fix(compat.can_skip_step)
    if not fused:
        return
    weight.grad = torch.ones(3)
    compat.set_found_inf(optimizer, torch.tensor(1.0))
    optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(3)), fix(compat.set_found_inf)
    compat.set_found_inf(optimizer, None)
    optimizer.step()
    assert (weight.detach() < 1).all()


def test_foreach_mul_scales_every_tensor_in_place():
    first, second = torch.ones(3), torch.full((2, 2), 2.0)
    compat.foreach_mul_([first, second], torch.tensor(0.5))
    assert torch.equal(first, torch.full((3,), 0.5)) and torch.equal(second, torch.ones(2, 2)), fix(compat.foreach_mul_)


def test_maybe_mark_dynamic_compiles_one_graph_for_every_size():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    double = torch.compile(lambda tensor: tensor * 2, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    try:
        for size in (3, 4, 5):
            tensor = torch.ones(size)
            compat.maybe_mark_dynamic(tensor, 0)
            double(tensor)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1, fix(compat.maybe_mark_dynamic)


# --------------------------------------------------------------------------------------------------- transformers
def test_attn_implementation_is_the_one_set():
    model = tiny(TINY_LLAMA, attn_implementation="eager")
    assert compat.attn_implementation(model.config) == "eager", fix(compat.attn_implementation)
    model.set_attn_implementation("sdpa")
    assert compat.attn_implementation(model.config) == "sdpa", fix(compat.attn_implementation)


def test_experts_implementation_is_what_the_experts_dispatch_on():
    model = tiny(TINY_MOE)
    experts = model.model.layers[0].mlp.experts
    for implementation in ("grouped_mm", "batched_mm"):
        model.set_experts_implementation(implementation)
        assert model.get_experts_implementation() == {"": implementation}
        assert compat.experts_implementation(experts.config) == implementation, fix(compat.experts_implementation)


def test_no_split_modules_names_the_blocks():
    assert compat.no_split_modules(tiny(TINY_LLAMA)) == {"LlamaDecoderLayer"}, fix(compat.no_split_modules)
    assert compat.no_split_modules(nn.Linear(2, 2)) == set()


def test_expert_parallelism_marks_the_modules_it_hooks():
    assert "module._is_hooked = True" in inspect.getsource(apply_expert_parallelism), fix(compat.mark_expert_parallel)


def test_all_to_all_dispatch_is_two_halves():
    assert calls_in_order(AllToAllEP.__call__, "self._dispatch_tokens(hidden_states, top_k_index, top_k_weights)",
                          "self.experts_forward(", "self._combine_tokens(expert_output, state)"), (
        f"{fix(compat.dispatch_tokens)} and compat.combine_tokens, and compare AllToAllEP.__call__ with "
        "lit_dllm.parallel.AutocastSafeAllToAllEP")


def test_output_recording_registry_makes_hidden_states_work():
    model = tiny(TINY_LLAMA)
    ids = torch.tensor([[1, 2, 3]])
    dict.pop(_CAN_RECORD_REGISTRY, str(type(model.model)))  # as in a process that unpickled the model
    assert model(ids, output_hidden_states=True).hidden_states is None, fix(compat.register_output_recording)
    compat.register_output_recording(model)
    assert len(model(ids, output_hidden_states=True).hidden_states) == 3, fix(compat.register_output_recording)


# ------------------------------------------------------------------------------------------------------- datasets
def test_dataset_fingerprint_is_what_map_names():
    rows = Dataset.from_dict({"a": [1, 2]})
    assert isinstance(compat.dataset_fingerprint(rows), str), fix(compat.dataset_fingerprint)
    mapped = rows.map(lambda row: row, new_fingerprint="given")
    assert compat.dataset_fingerprint(mapped) == "given", fix(compat.dataset_fingerprint)
