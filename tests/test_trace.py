"""Pictures of what a model does (lit_dllm.core.trace, lit_dllm.families.dflash.acceptance): every sampler's denoising
trace rebuilds its answer exactly and leaves it unchanged (bit for bit the answers of the samplers before traces
existed), DFlash's accepted lengths add up to its answer, validation draws both into TensorBoard when asked, and a
run's curves (MDLM's masked accuracy by noise level among them) are read back from its own logs."""

import importlib.util

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_dllm import (BuiltinTask, Collation, DataSource, DenoisingTrace, DLLMDataModule, LLaDAGeneration, Loader,
                      MDLMModule)
from lit_dllm.core.trace import curves_figure, run_scalars
from lit_dllm.families.dflash.acceptance import accepted_per_position, acceptance_figure
from lit_dllm.families.mdlm.fast_sampler import fast_generate
from lit_dllm.families.mdlm.module import NOISE_LEVELS, by_noise_level
from lit_dllm.families.mdlm.sampler import llada_generate
from lit_dllm.testing import TINY_DIFFUSION_GEMMA, TINY_LLAMA

from tests.families.dflash.test_dflash import TOK, dflash
from tests.families.dflash.test_dflash import data as dflash_data
from tests.families.diffusion_gemma.test_diffusion_gemma import gemma
from tests.families.mdlm.test_fast_sampler import PROMPTS, V, denoiser, run

EOS = 1
SAMPLERS = {"llada": llada_generate, "fast": fast_generate}
BEFORE_TRACES = [  # the answers of the samplers at the commit before traces (a random denoiser, mask never chosen)
    ("llada", {"temperature": 1.0}, [[], [], [4, 8, 0, 6, 10, 6, 4], []]),
    ("llada", {"remasking": "random", "temperature": 1.0},
     [[2, 9, 10, 8, 10, 7, 10, 9], [8, 9, 5, 4, 3, 2, 10, 0], [6, 5, 9, 5, 0, 9], []]),
    ("llada", {}, [[4] * 8] * 4),
    ("fast", {"cache": "none", "threshold": 0.3, "temperature": 1.0}, [[], [], [4, 8, 0, 6, 10, 6, 4], []]),
    ("fast", {"cache": "prefix", "threshold": 0.3, "temperature": 1.0}, [[], [], [4, 8, 0, 6, 10, 6, 4], []]),
    ("fast", {"cache": "dual", "threshold": 0.3, "temperature": 1.0}, [[], [], [4, 8, 0, 6, 10, 6, 4], []]),
    ("fast", {"cache": "dual", "remasking": "random", "temperature": 1.0},
     [[2, 9, 10, 8, 10, 7, 10, 9], [8, 9, 5, 4, 3, 2, 10, 0], [6, 5, 9, 5, 0, 9], []]),
]


@pytest.fixture
def drawing():
    """matplotlib, which draws the pictures: the dev and notebooks extras (absent from the GPU image: skipped there)."""
    pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def model():
    """A random 2-layer denoiser that never chooses the mask token (as a trained one does not)."""
    model = denoiser(2, seed=1)
    model.hf.lm_head.register_forward_hook(lambda mod, args, out: out.index_fill(-1, torch.tensor([V - 1]), -torch.inf))
    return model


@pytest.mark.parametrize("name, settings, before", BEFORE_TRACES)
def test_a_trace_rebuilds_each_answer_and_changes_none(model, name, settings, before):
    calls = []
    hook = model.hf.register_forward_pre_hook(lambda *_: calls.append(1))
    trace = DenoisingTrace()
    try:
        traced = run(SAMPLERS[name], model, trace=trace, **settings)
    finally:
        hook.remove()
    assert run(SAMPLERS[name], model, **settings) == before == traced
    assert [trace.answer(row, EOS).tolist() for row in range(len(PROMPTS))] == before
    assert trace.num_steps(0) == len(calls)  # one recorded step per model call
    assert trace.step_of.shape == (len(PROMPTS), 8)
    committed = trace.step_of >= 0
    confidence = trace.confidence[committed]
    assert ((confidence > 0) & (confidence <= 1)).all() and trace.confidence[~committed].isnan().all()
    if settings.get("threshold") is None and settings.get("remasking") != "random":
        # LLaDA's schedule (8 steps over 2 blocks of 4): one position a step, block after block
        assert sorted(trace.step_of[2].tolist()) == list(range(8))


def test_the_picture_lights_each_committed_position_once_at_its_step(model, drawing):
    trace = DenoisingTrace()
    run(llada_generate, model, trace=trace, temperature=1.0)
    image = trace.image(2)
    assert image.shape == (trace.num_steps(2), 8)
    assert ((~image.isnan()).sum(0) == (trace.step_of[2] >= 0).long()).all()
    figure = trace.figure(2, title="row 2")
    assert figure.axes[0].get_title() == "row 2" and len(figure.axes[0].get_xticklabels()) == 8


def test_gemma_generate_records_each_canvas_and_answers_the_same():
    module = gemma()
    prompts = [torch.tensor(TOK(p)["input_ids"]) for p in ("rev 12=", "rev 4821=", "rev 34=")]
    trace = DenoisingTrace()
    traced = module.generate_ids(prompts, 8, trace=trace)
    plain = module.generate_ids(prompts, 8)
    assert [a.tolist() for a in traced] == [a.tolist() for a in plain]
    assert [trace.answer(row, TOK.eos_token_id).tolist() for row in range(3)] == [a.tolist() for a in plain]
    block = TINY_DIFFUSION_GEMMA["canvas_length"]
    assert trace.step_of.shape == (3, 8) and (trace.step_of >= 0).all()  # two canvases, each settled by its end
    steps = trace.step_of.view(3, 2, block)
    assert (steps[:, 1].min(1).values > steps[:, 0].max(1).values).all()  # the second canvas's steps come later


def test_dflash_accepted_lengths_add_up_to_the_answer(drawing):
    module = dflash().eval()
    decoded = module.speculative_decode(torch.tensor(TOK("rev 5120=")["input_ids"]), 12)
    assert decoded.accepted and 1 + sum(decoded.accepted) == len(decoded.tokens)  # the prefill's token, then each step
    rate = accepted_per_position(decoded.accepted, module.block_size)
    assert rate[0] == 1 and (rate[1:] <= rate[:-1]).all()
    assert float(rate.sum()) == pytest.approx(sum(decoded.accepted) / len(decoded.accepted))
    figure = acceptance_figure(decoded.accepted, module.block_size)
    assert len(figure.axes) == 2
    assert accepted_per_position([1, 3, 2, 4], 4).tolist() == [1.0, 0.75, 0.5, 0.25]


def logged(logger: TensorBoardLogger) -> EventAccumulator:
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "histograms": 0})
    events.Reload()
    return events


def fit_tiny_mdlm(tmp_path, **generation) -> TensorBoardLogger:
    """4 steps of a tiny MDLM, validated (and its first 8 prompts answered) at steps 2 and 4, logged to TensorBoard."""
    data = DLLMDataModule(source=DataSource(path="task:reverse"), max_seq_len=24, loader=Loader(batch_size=8),
                          task=BuiltinTask(num_train=32, num_val=8, kwargs={"min_len": 2, "max_len": 4}),
                          collation=Collation(supervise_padding=True))
    module = MDLMModule(vocab_size=data.vocab_size, mask_token_id=data.mask_token_id, pad_token_id=data.pad_token_id,
                        eos_token_id=data.eos_token_id, backbone={"model_config": TINY_LLAMA},
                        generation=LLaDAGeneration(gen_length=6, **generation))
    logger = TensorBoardLogger(tmp_path, name="run")
    L.Trainer(max_steps=4, accelerator="cpu", logger=logger, log_every_n_steps=1, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, val_check_interval=2,
              check_val_every_n_epoch=None, limit_val_batches=1, num_sanity_val_steps=0).fit(module, data)
    return logger


def test_validation_draws_the_denoising_trace_when_asked(tmp_path, drawing):
    events = logged(fit_tiny_mdlm(tmp_path, val_trace=True))
    assert [image.step for image in events.Images("val/trace")] == [2, 4]
    assert events.Images("val/trace")[0].width > 100


def test_a_run_reads_back_its_own_curves_and_draws_no_picture_unasked(tmp_path, drawing):
    logger = fit_tiny_mdlm(tmp_path)
    assert logged(logger).Tags()["images"] == []
    scalars = run_scalars(logger.log_dir)
    steps, losses = scalars["train/loss"]
    assert steps == [0, 1, 2, 3] and len(losses) == 4  # logged before each optimizer step
    assert scalars["val/exact_match"][0] == [1, 3]  # Lightning logs a validation at the step before
    by_noise = [tag for tag in (f"val/masked_accuracy_{level}" for level in NOISE_LEVELS) if tag in scalars]
    assert len(by_noise) >= 2  # the bands the 8 examples' noise rates fall in
    figure = curves_figure(scalars, ["train/loss", by_noise])
    assert [len(ax.lines) for ax in figure.axes] == [1, len(by_noise)]
    assert {ax.get_xlabel() for ax in figure.axes} == {"optimizer step"}
    relabelled = curves_figure(scalars, ["train/loss"], xlabel="batch of rollouts")
    assert relabelled.axes[0].get_xlabel() == "batch of rollouts"
    with pytest.raises(KeyError, match="logged no \\['val/nothing'\\]"):
        curves_figure(scalars, ["val/nothing"])


def test_masked_accuracy_by_noise_level_counts_each_band():
    rate = torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3], [0.9, 0.9, 0.9]])
    scored = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    correct = torch.tensor([[1, 0, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool) & scored
    counts = {level: (int(c), int(n)) for level, (c, n) in by_noise_level(correct, scored, rate).items()}
    assert counts == {"t25": (1, 2), "t50": (3, 3), "t75": (0, 0), "t100": (1, 2)}


def test_dflash_validation_draws_the_accepted_lengths_when_asked(tmp_path, drawing):
    module = dflash(generation={"val_generate_batches": 1, "val_trace": True, "gen_length": 6})
    logger = TensorBoardLogger(tmp_path, name="run")
    L.Trainer(max_steps=1, accelerator="cpu", logger=logger, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, val_check_interval=1, check_val_every_n_epoch=None, limit_val_batches=1,
              num_sanity_val_steps=0).fit(module, dflash_data(task={"num_val": 2}))
    events = logged(logger)
    assert [image.step for image in events.Images("val/acceptance")] == [1]
    assert events.Histograms("val/accepted_lengths")[0].histogram_value.min >= 1


def test_pictures_asked_without_matplotlib_name_the_extra(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(ImportError, match="val_trace=True draws with matplotlib.*lit_dllm\\[notebooks\\]"):
        MDLMModule(vocab_size=V, mask_token_id=V - 1, backbone={"model_config": TINY_LLAMA},
                   generation={"val_trace": True})
    with pytest.raises(ImportError, match="lit_dllm\\[notebooks\\]"):
        dflash(generation={"val_trace": True})
    MDLMModule(vocab_size=V, mask_token_id=V - 1, backbone={"model_config": TINY_LLAMA})  # not asked: no matplotlib needed


def test_pictures_asked_of_a_validation_that_answers_nothing_are_refused():
    with pytest.raises(ValueError, match="val_trace=True with val_generate_batches=0"):
        MDLMModule(vocab_size=V, mask_token_id=V - 1, backbone={"model_config": TINY_LLAMA},
                   generation={"val_trace": True, "val_generate_batches": 0})
    with pytest.raises(ValueError, match="val_trace=True with val_generate_batches=0"):
        dflash(generation={"val_trace": True, "val_generate_batches": 0})
