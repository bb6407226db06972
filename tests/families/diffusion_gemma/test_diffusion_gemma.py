"""Block-diffusion Gemma (BlockDiffusionGemmaModule on transformers' DiffusionGemma): no leakage, train/serve
parity with transformers' own inference path, gradients through the encoder KV, keyed choices, resume, learning,
export, and clear errors."""

import dataclasses
import warnings

import lightning as L
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache
from transformers.integrations import flex_attention as flex_integration

from lit_dllm import (
    BlockDiffusionCrossEntropyLoss,
    BlockDiffusionGemmaModule,
    CausalLMModule,
    DLLMDataModule,
    build_default_tokenizer,
    encoder_ar_loss,
)
from lit_dllm.callbacks import RunSummary, ThroughputMonitor
from lit_dllm.experts import experts_loop_reason
from lit_dllm.parallel import apply_compile
from lit_dllm.noise.keys import Stream, example_keys, keyed_uniform
from lit_dllm.losses import weighted_linear_cross_entropy
from lit_dllm.families.diffusion_gemma import model as gemma_model, module as gemma_module
from lit_dllm.testing import TINY_DIFFUSION_GEMMA, TINY_LLAMA

from tests.core.test_resume_and_errors import RecordLosses
from tests.data.test_datamodule import data_module

TOK = build_default_tokenizer()
BLOCK = TINY_DIFFUSION_GEMMA["canvas_length"]


def data(**settings) -> DLLMDataModule:
    defaults = {"source": {"path": "task:reverse"}, "task": {"kwargs": {"min_len": 2, "max_len": 8}, "num_train": 64,
                "num_val": 16}, "loader": {"batch_size": 8}, "max_seq_len": 32,
                "collation": {"pad_block_size": BLOCK, "response_window": True}}
    return data_module(defaults, **settings)


def gemma(dm: DLLMDataModule | None = None, dtype: torch.dtype = torch.float32, attention: str = "eager",
          model_config: dict = TINY_DIFFUSION_GEMMA, **kwargs) -> BlockDiffusionGemmaModule:
    torch.manual_seed(0)
    module = BlockDiffusionGemmaModule(
        vocab_size=len(TOK), pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id,
        backbone={"model_config": model_config, "attn_implementation": attention},
        generation={"val_generate_batches": 0}, **kwargs
    )
    module.configure_model()
    if dtype == torch.float64:
        module.model.hf.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return module.to(dtype)


def batch(dm: DLLMDataModule, size: int = 8, start: int = 0) -> dict:
    """Training examples ``start`` .. ``start + size`` collated as the data module's loader does."""
    dm.setup("fit")
    rows = [{k: v for k, v in dm.train_dataset[i].items() if k != "length"} for i in range(start, start + size)]
    return {**dm.collator(rows), "epoch": 0}


def canvas_logits(module, b, prepared) -> torch.Tensor:
    hidden, _ = module.model.denoise(b["input_ids"], prepared["encoder_masks"], prepared["canvas_ids"],
                                     prepared["decoder_masks"], prepared["decoder_positions"])
    return module.model.logits(hidden)


def prepare(module, b, epoch=0):
    return module.prepare_batch(b, example_keys(42, b["example_index"], epoch))


def at_loss(canvas: torch.Tensor, prepared: dict) -> torch.Tensor:
    """``[B, R, ...]`` canvas values at the loss positions ``[B, K]``."""
    index = prepared["loss_index"]
    return canvas.take_along_dim(index.view(*index.shape, *[1] * (canvas.dim() - 2)), 1)


def response_start(b) -> torch.Tensor:
    return b["loss_mask"].bool().int().argmax(1)


# ---------------------------------------------------------------------------------------------------- the masks
def test_a_canvas_block_never_sees_the_clean_tokens_of_its_own_or_later_blocks():
    """float64 eager: block n's logits are bit-identical when the clean tokens of blocks >= n change."""
    dm = data()
    module = gemma(dtype=torch.float64).eval()
    b = batch(dm)
    prepared = prepare(module, b)
    base = canvas_logits(module, b, prepared)
    start, lengths = response_start(b), b["attention_mask"].sum(1) - response_start(b)
    for block in range(int(lengths.max()) // BLOCK):
        changed = b["input_ids"].clone()
        for row in range(len(changed)):
            first = int(start[row]) + block * BLOCK
            changed[row, first:] = torch.randint(3, len(TOK), changed[row, first:].shape)
        logits = canvas_logits(module, {**b, "input_ids": changed}, prepared)
        rows = slice(block * BLOCK, (block + 1) * BLOCK)
        assert torch.equal(logits[:, rows], base[:, rows]), block
        if block + 1 < int(lengths.max()) // BLOCK:  # a later block does see block n's clean tokens
            later = slice((block + 1) * BLOCK, (block + 2) * BLOCK)
            assert not torch.equal(logits[:, later], base[:, later])


def test_training_logits_equal_transformers_inference_path():
    """Each canvas block's training-path logits equal prefix encode + block decode as transformers' generate runs
    them (incremental encoder, sliding cache trimmed to the window), within 1e-5 in fp32."""
    dm = data(task={"kwargs": {"min_len": 8, "max_len": 8}})
    module = gemma().eval()
    b = batch(dm, 2)
    prepared = prepare(module, b)
    train_logits = canvas_logits(module, b, prepared)
    hf = module.model.hf
    for row in range(2):
        start, end = int(response_start(b)[row]), int(b["attention_mask"][row].sum())
        ids = b["input_ids"][row : row + 1]
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        encoded = 0
        for block in range((end - start) // BLOCK):
            upto = start + block * BLOCK
            new = ids[:, encoded:upto]
            positions = torch.arange(encoded, upto)[None]
            masks = hf.model.encoder.create_masks_for_generate(
                config=hf.config, inputs_embeds=torch.empty(1, new.shape[1], 0), attention_mask=torch.ones(1, upto,
                dtype=torch.bool), cache=cache, position_ids=positions)
            hf.model.encoder(input_ids=new, attention_mask=masks, cache=cache, position_ids=positions)
            encoded = upto
            canvas = prepared["canvas_ids"][row : row + 1, block * BLOCK : (block + 1) * BLOCK]
            decoder_masks = hf.model.decoder.create_diffusion_decoder_attention_mask(
                config=hf.config, inputs_embeds=canvas.unsqueeze(-1), cache=cache,
                decoder_attention_mask=torch.ones(1, upto + BLOCK, dtype=torch.bool))
            served = hf(cache=cache, decoder_input_ids=canvas, decoder_attention_mask=decoder_masks,
                        decoder_position_ids=torch.arange(upto, upto + BLOCK)[None]).logits
            trained = train_logits[row : row + 1, block * BLOCK : (block + 1) * BLOCK]
            torch.testing.assert_close(trained, served, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_flex_attention_block_masks_give_the_dense_masks_step(device, monkeypatch):
    """fp32, a padded batch through the training step (encoder, both decoder passes, both losses):
    ``attn_implementation="flex_attention"`` (BlockMasks) gives eager attention's loss (dense masks) and, on CUDA,
    its gradients, through transformers' compiled flex_attention. On the CPU torch's FlexAttention has no backward,
    and its compiled CPU kernel is wrong at some lengths (torch 2.13: e.g. 8 queries over 40 keys, even unmasked), so
    there the step runs without gradients on eager flex_attention (the masks through the real model)."""
    if device == "cpu":
        def eager(query, key, value, training=False, **kwargs):
            return flex_attention(query, key, value, **kwargs)

        monkeypatch.setattr(flex_integration, "compile_friendly_flex_attention", eager)
    b = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch(data()).items()}
    assert not b["attention_mask"].all()  # padded rows: padded keys and pad canvas rows are masked
    dense = gemma().to(device).train()
    flex = gemma(attention="flex_attention").to(device).train()
    flex.load_state_dict(dense.state_dict())
    assert isinstance(prepare(flex, b)["decoder_masks"]["sliding_attention"], BlockMask)
    losses = []
    for module in (dense, flex):
        with torch.set_grad_enabled(device == "cuda"):
            prepared = prepare(module, b)
            counts = {k: v.float() for k, v in module.token_counts(b, prepared).items()}
            step = module.compute_loss(b, prepared, counts)
        if device == "cuda":
            step.output.total_loss.backward()
        losses.append(step.output.total_loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    if device == "cuda":
        pairs = [(name, p.grad, q.grad) for (name, p), q in zip(dense.named_parameters(), flex.parameters())
                 if p.grad is not None]
        assert pairs and all(got is not None for _, _, got in pairs)
        differences = {name: float((got - want).norm() / want.norm().clamp_min(1e-12)) for name, want, got in pairs}
        worst = max(differences, key=differences.get)
        print(f"flex vs eager gradients: largest relative norm difference {differences[worst]:.2e} ({worst})")
        assert differences[worst] < 1e-4, differences


@pytest.mark.parametrize(("capability", "backward"), [((9, 0), True), ((8, 0), False)])
def test_flex_kernel_options_tile_by_head_dim_and_gpu(capability, backward, monkeypatch):
    """Heads over 256 get forward tiles of 32 (torch's default ones do not fit in shared memory); on sm90 the head
    dims 256 and 512 also get the backward tiles timed fastest on an H200; everything else keeps torch's defaults."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu, wide_forward = torch.device("cuda", 0), {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32, "fwd_num_stages": 2}
    hopper_512 = {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 32,
                  "bwd_num_stages": 2, "bwd_num_warps": 8}
    hopper_256 = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                  "bwd_num_stages": 2, "bwd_num_warps": 8}
    assert gemma_model.flex_kernel_options(512, gpu) == {**wide_forward, **(hopper_512 if backward else {})}
    assert gemma_model.flex_kernel_options(256, gpu) == (hopper_256 if backward else {})
    assert gemma_model.flex_kernel_options(128, gpu) == {}
    assert gemma_model.flex_kernel_options(512, torch.device("cpu")) == wide_forward


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_each_flex_layer_gets_the_kernel_options_of_its_head_dim(monkeypatch):
    """transformers hands the same keyword arguments to every layer; with sliding layers of head dim 16 and a global
    layer of 32, each encoder and decoder attention call of the step receives the options of its own head dim."""
    seen = []

    def recording(query, key, value, training=False, kernel_options=None, **kwargs):
        seen.append((query.shape[-1], kernel_options))
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(flex_integration, "compile_friendly_flex_attention", recording)
    monkeypatch.setattr(gemma_model, "flex_kernel_options", lambda head_dim, device: {"tiles_for": head_dim})
    text = dict(TINY_DIFFUSION_GEMMA["text_config"], global_head_dim=32, num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"])
    module = gemma(attention="flex_attention", model_config=dict(TINY_DIFFUSION_GEMMA, text_config=text)).train()
    b = batch(data())
    with torch.no_grad():
        prepared = prepare(module, b)
        module.compute_loss(b, prepared, {k: v.float() for k, v in module.token_counts(b, prepared).items()})
    assert len(seen) == 2 * 3  # two layers; the encoder and both decoder passes
    assert all(options == {"tiles_for": head_dim} for head_dim, options in seen)
    assert {head_dim for head_dim, _ in seen} == {16, 32}
    seen.clear()  # a caller's own kernel_options reach every layer unchanged
    with torch.no_grad():
        module.model.hf.model.encoder(input_ids=b["input_ids"], attention_mask=prepared["encoder_masks"],
                                      cache=DynamicCache(), kernel_options={"own": 1})
    assert [options for _, options in seen] == [{"own": 1}] * 2


@pytest.mark.parametrize(("attention", "dynamic"), [("eager", None), ("flex_attention", False)])
def test_blocks_compile_with_static_shapes_under_flex_attention(attention, dynamic, monkeypatch):
    """FlexAttention's compiled blocks take no automatic dynamic shapes (inductor's flex lowering fails on a symbolic
    head size); other attention keeps them."""
    requested = []
    monkeypatch.setattr(torch, "compile", lambda forward, **options: requested.append(options["dynamic"]) or forward)
    blocks = apply_compile(gemma(attention=attention).model)
    assert requested == [dynamic] * len(blocks) and blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_blocks_with_two_head_sizes_give_the_eager_step():
    """fp32 on a GPU, sliding layers of head size 16 and global layers of 32 (as 26B-A4B's 256 and 512): the blocks
    compiled by inductor under FlexAttention give the uncompiled step's loss and gradients (symbolic head sizes
    failed to lower here: torch 2.11). In bf16 the two differed by up to 16 % in the gradients of this random tiny
    model's attention projections (3.5e-6 in fp32, one H200), so fp32 is the check."""
    text = dict(TINY_DIFFUSION_GEMMA["text_config"], global_head_dim=32, num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"])
    config = dict(TINY_DIFFUSION_GEMMA, text_config=text)
    b = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch(data()).items()}
    modules = [gemma(attention="flex_attention", model_config=config).cuda().train() for _ in range(2)]
    apply_compile(modules[1].model)
    losses = []
    for module in modules:
        prepared = prepare(module, b)
        counts = {k: v.float() for k, v in module.token_counts(b, prepared).items()}
        loss = module.compute_loss(b, prepared, counts).output.total_loss
        loss.backward()
        losses.append(loss.detach())
    differences = {name: float((compiled.grad - eager.grad).norm() / eager.grad.norm().clamp_min(1e-12))
                   for (name, eager), compiled in zip(modules[0].named_parameters(), modules[1].parameters())
                   if eager.grad is not None}
    worst = max(differences, key=differences.get)
    print(f"compiled vs eager flex: losses {losses}, largest gradient difference {differences[worst]:.2e} ({worst})")
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert differences[worst] < 1e-4, differences


# ------------------------------------------------------------------------------------------------ the loss
def test_the_diffusion_loss_alone_trains_the_encoder_pass():
    """encoder_loss_weight=0: the prompt's embeddings (seen only by the encoder) still get gradients, through the
    encoder KV that the canvas attends to (docs/DESIGN.md §9.1: not detached)."""
    dm = data()
    module = gemma(encoder_loss_weight=0.0).train()
    b = batch(dm)
    captured = []

    def keep(mod, args, out):
        out.retain_grad()
        captured.append(out)

    hook = module.model.hf.model.encoder.language_model.embed_tokens.register_forward_hook(keep)
    prepared = prepare(module, b)
    assert "ar_scored" not in prepared
    step = module.compute_loss(b, prepared, {"diffusion": prepared["scored"].sum().float()})
    step.output.total_loss.backward()
    hook.remove()
    prompt = torch.arange(b["input_ids"].shape[1])[None] < response_start(b)[:, None]
    assert captured[0].grad[prompt].abs().sum() > 0
    assert not step.extra


def test_the_fused_step_equals_the_public_losses_on_dense_logits():
    """One loss formula: the module's fused head gives BlockDiffusionCrossEntropyLoss on the scored canvas block plus
    encoder_loss_weight x encoder_ar_loss over the attended sequence, both with the given global denominators."""
    dm = data()
    module = gemma(encoder_loss_weight=0.5).train()
    b = batch(dm)
    prepared = prepare(module, b)
    counts = {k: v.float() + 3 for k, v in module.token_counts(b, prepared).items()}  # as if other ranks had more
    step = module.compute_loss(b, prepared, counts)
    hidden, encoded = module.model.denoise(b["input_ids"], prepared["encoder_masks"], prepared["canvas_ids"],
                                           prepared["decoder_masks"], prepared["decoder_positions"], prepared["coins"])
    targets, scored, logits = prepared["targets"], prepared["scored"], at_loss(module.model.logits(hidden), prepared)
    diffusion = BlockDiffusionCrossEntropyLoss()(logits, targets, scored, torch.ones_like(
        targets, dtype=torch.float), scored, num_diffusion_tokens=counts["diffusion"]).total_loss
    ar = encoder_ar_loss(module.model.logits(encoded), b["input_ids"], b["attention_mask"], counts["ar"])
    torch.testing.assert_close(step.output.dllm_loss, diffusion)
    torch.testing.assert_close(step.extra["ar_loss"], ar)
    torch.testing.assert_close(step.output.total_loss, diffusion + 0.5 * ar)
    # the head's gradients, formed in the forward pass, equal autograd's through the dense soft-capped logits
    params = [p for p in module.parameters() if p.requires_grad]
    got = torch.autograd.grad(step.output.total_loss, params, allow_unused=True)
    want = torch.autograd.grad(diffusion + 0.5 * ar, params, allow_unused=True)
    for a, b_ in zip(got, want):
        assert (a is None) == (b_ is None)
        if a is not None:
            torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-6)


def test_the_lm_head_runs_once_over_both_losses_rows(monkeypatch):
    """The tied embedding / LM head gets one gradient from the loss, not one per loss: the canvas rows and the
    encoder's rows go through one head call, each weighted by its loss's 1 / denominator (the AR ones times
    encoder_loss_weight)."""
    module = gemma(encoder_loss_weight=0.5).train()
    b = batch(data())
    prepared = prepare(module, b)
    counts = {k: v.float() + 3 for k, v in module.token_counts(b, prepared).items()}
    calls = []

    def head(hidden, weight, targets, row_weights, **kwargs):
        calls.append(row_weights)
        return weighted_linear_cross_entropy(hidden, weight, targets, row_weights, **kwargs)

    monkeypatch.setattr(gemma_model, "weighted_linear_cross_entropy", head)
    module.compute_loss(b, prepared, counts)
    want = torch.cat([prepared["scored"].flatten() / counts["diffusion"],
                      prepared["ar_scored"].flatten() * 0.5 / counts["ar"]])
    assert len(calls) == 1
    torch.testing.assert_close(calls[0], want)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_fixed_shape_loss_equals_boolean_indexing_of_the_scored_positions(training):
    """Loss, gradients, accuracy counts and token counts equal a hand-built reference that selects the scored rows
    by boolean indexing (training: the supervised positions of the keyed canvas block; evaluation: of every block)."""
    module = gemma(encoder_loss_weight=0.5).train(training)
    b = batch(data())
    keys = example_keys(42, b["example_index"], 0)
    prepared = module.prepare_batch(b, keys)
    counts = {k: v.float() for k, v in module.token_counts(b, prepared).items()}
    step = module.compute_loss(b, prepared, counts)

    ids, attended = b["input_ids"], b["attention_mask"].bool()
    start = response_start(b)
    lengths = attended.sum(1) - start
    offsets = torch.arange(int(lengths.max()))
    positions = (start[:, None] + offsets).clamp_max(ids.shape[1] - 1)
    scored = b["loss_mask"].bool().gather(1, positions) & (offsets < lengths[:, None])
    if training:
        chosen = (keyed_uniform(keys, Stream.CANVAS_BLOCK) * (lengths // BLOCK)).long()
        scored &= offsets // BLOCK == chosen[:, None]
    hidden, encoded = module.model.denoise(ids, prepared["encoder_masks"], prepared["canvas_ids"],
                                           prepared["decoder_masks"], positions, prepared.get("coins"))
    logits, targets = module.model.logits(hidden)[scored], ids.gather(1, positions)[scored]
    diffusion = torch.nn.functional.cross_entropy(logits, targets, reduction="sum") / scored.sum()
    want = diffusion
    if training:
        next_scored = attended[:, 1:]
        ar_logits = module.model.logits(encoded)[:, :-1][next_scored]
        ar = torch.nn.functional.cross_entropy(ar_logits, ids[:, 1:][next_scored], reduction="sum") / next_scored.sum()
        want = diffusion + 0.5 * ar
        assert counts["ar"] == next_scored.sum()
        torch.testing.assert_close(step.extra["ar_loss"], ar)
    real = (torch.arange(ids.shape[1]) < b["input_lengths"][:, None]).gather(1, positions)[scored]
    assert counts["diffusion"] == scored.sum()
    assert step.num_scored == real.sum() and step.num_correct == ((logits.argmax(-1) == targets) & real).sum()
    torch.testing.assert_close(step.output.dllm_loss, diffusion)
    torch.testing.assert_close(step.output.total_loss, want)
    if training:
        params = [p for p in module.parameters() if p.requires_grad]
        got = torch.autograd.grad(step.output.total_loss, params, allow_unused=True)
        expected = torch.autograd.grad(want, params, allow_unused=True)
        for name, a, b_ in zip([n for n, p in module.named_parameters() if p.requires_grad], got, expected):
            assert (a is None) == (b_ is None), name
            if a is not None:
                torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-6, msg=name)


def test_window_errors_name_the_first_bad_row():
    module, prefix = gemma(), torch.tensor([3, 5, 7, 9])
    with pytest.raises(ValueError, match="Row 2's response window holds 6 tokens, not a multiple of canvas_length=4"):
        module._window_width(prefix, torch.tensor([4, 8, 6, 5]))
    with pytest.raises(ValueError, match="Row 1 has no response in its 5 tokens"):
        module._window_width(prefix, torch.tensor([4, 0, 8, 0]))
    assert module._window_width(prefix, torch.tensor([4, 12, 8, 4])) == 12


def test_the_transfer_reads_the_window_width_on_the_cpu(monkeypatch):
    """Lightning's transfer hook reads and checks the response windows while the batch is on the CPU; preparing the
    moved batch then reads no value back (no window check, no mask value check) and builds the same inputs."""
    module = gemma().train()
    b = batch(data())
    want = prepare(module, {**b})  # another dict, the same tensors: read by canvas_inputs
    moved = module.transfer_batch_to_device(b, torch.device("cpu"), 0)
    assert module._widest[1] == int((b["attention_mask"].sum(1) - response_start(b)).max())

    def no_read(*args):
        raise AssertionError("read a value of the moved batch")

    monkeypatch.setattr(module, "_window_width", no_read)
    monkeypatch.setattr("lit_dllm.families.diffusion_gemma.masks._check", no_read)
    got = prepare(module, moved)
    for key in ("canvas_ids", "decoder_positions", "loss_index", "targets", "scored", "real", "coins"):
        assert torch.equal(got[key], want[key]), key
    for name, mask in want["decoder_masks"].items():
        assert torch.equal(got["decoder_masks"][name], mask), name


def test_the_transfer_refuses_a_batch_whose_window_is_not_whole_canvases_except_to_predict():
    """The window's errors come before the step; prediction, which answers the prompts only, reads no window."""
    module, b = gemma().train(), batch(data())
    b["attention_mask"][2, b["attention_mask"][2].sum() - 1] = 0  # one attended token fewer: not a whole canvas
    with pytest.raises(ValueError, match="Row 2's response window holds .* not a multiple of canvas_length=4"):
        module.transfer_batch_to_device(b, torch.device("cpu"), 0)
    trainer = L.Trainer(accelerator="cpu", logger=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    trainer.predicting = True
    assert module.transfer_batch_to_device(b, torch.device("cpu"), 0)["input_ids"] is b["input_ids"]


def test_training_flops_reuse_the_width_of_the_prepared_batch(monkeypatch):
    """The MFU callback's ``training_flops`` after the step reads no tensor of that batch (no device sync); another
    batch's width is read from it."""
    module = gemma().train()
    b = batch(data())
    prepare(module, b)
    expected = module.training_flops(b)
    other = {**b, "input_ids": b["input_ids"].clone()}
    assert module.training_flops(other) == expected  # read from the batch
    monkeypatch.setattr(gemma_module, "response_windows", None)  # any read of the batch would fail
    assert module.training_flops(b) == expected


def test_the_throughput_monitor_gets_the_flops_from_the_training_step(tmp_path, monkeypatch):
    """In a fit, ``training_flops`` sees the batch that the step prepared: the response windows are read twice a step
    (on the CPU by the transfer, on the device by ``canvas_inputs``), not a third time for the flops."""
    reads = []
    windows = gemma_module.response_windows
    monkeypatch.setattr(gemma_module, "response_windows", lambda batch: reads.append(1) or windows(batch))
    fit(tmp_path, ThroughputMonitor(peak_flops=1e12), max_steps=3)
    assert len(reads) == 2 * 3


@pytest.fixture(scope="module", params=["eager", "flex_attention"])
def step_syncs(request) -> dict[str, list[str]]:
    """``file:line`` of each host-device synchronisation of prepare_batch + compute_loss after a warm-up step, bf16
    on a GPU (the experts' grouped GEMM then needs no host copy of their group sizes), for a batch moved by Lightning's
    transfer hook and for one moved by other code."""
    reason = experts_loop_reason("grouped_mm", torch.bfloat16, torch.cuda.get_device_capability())
    if reason:
        pytest.skip(reason)
    module = gemma(dtype=torch.bfloat16, attention=request.param).cuda().train()
    on_cpu = batch(data())

    def step(b: dict) -> torch.Tensor:
        prepared = prepare(module, b)
        counts = {k: v.float() for k, v in module.token_counts(b, prepared).items()}
        return module.compute_loss(b, prepared, counts).output.total_loss

    moves = {"hook": lambda: module.transfer_batch_to_device(on_cpu, torch.device("cuda"), 0),
             "other code": lambda: {k: v.cuda() if torch.is_tensor(v) else v for k, v in on_cpu.items()}}
    syncs = {}
    for name, move in moves.items():
        step(move()).backward()  # compilation and lazy initialisation may synchronise
        b = move()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(b)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs[name] = [f"{w.filename}:{w.lineno}" for w in caught
                       if "called a synchronizing CUDA operation" in str(w.message)]
    return syncs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_training_step_never_waits_for_the_gpu(step_syncs):
    """Moved by Lightning's transfer hook (which read the window width on the CPU), a batch's step never waits for
    the device: no read of the windows, no mask value check, none in the model's forward or the loss (no boolean
    indexing). Moved by other code, it waits once, for the windows' check and width."""
    assert step_syncs["hook"] == []
    assert len(step_syncs["other code"]) == 1 and "diffusion_gemma/module.py" in step_syncs["other code"][0], step_syncs


def test_training_scores_one_canvas_block_per_example_and_evaluation_scores_all():
    dm = data()
    module = gemma()
    b = batch(dm)
    train = prepare(module.train(), b)
    evaluation = prepare(module.eval(), b)
    for row in range(len(b["input_ids"])):
        index = train["loss_index"][row]
        assert index[0] % BLOCK == 0 and torch.equal(index, index[0] + torch.arange(BLOCK))  # one whole block
        assert train["scored"][row].any()
        supervised = evaluation["scored"][row].sum()
        assert supervised == b["attention_mask"][row].sum() - response_start(b)[row]
    assert "coins" not in evaluation and "ar_scored" not in evaluation


def test_block_choice_coins_and_noise_depend_only_on_the_example():
    """Keyed by (seed, example index, epoch): the same per example in a batch of 8 or in two batches of 4 (an
    accumulation split, or two data-parallel ranks), and different in another epoch."""
    dm = data()
    module = gemma().train()
    whole = batch(dm, 8)
    full = prepare(module, whole)
    for half in (slice(0, 4), slice(4, 8)):
        part = batch(dm, 4, half.start)
        split = prepare(module, part)
        assert torch.equal(split["coins"], full["coins"][half])
        for row in range(4):
            width = int(part["attention_mask"][row].sum() - response_start(part)[row])
            for key in ("loss_index", "scored", "canvas_ids"):
                assert torch.equal(split[key][row, :width], full[key][half.start + row, :width]), key
    other = prepare(module, whole, epoch=1)
    assert not torch.equal(other["canvas_ids"], full["canvas_ids"])


def test_the_coin_rate_follows_self_conditioning_p():
    module = gemma(self_conditioning_p=0.25).train()
    b = {"input_ids": torch.full((4000, 8), 5), "loss_mask": torch.ones(4000, 8),
         "attention_mask": torch.ones(4000, 8, dtype=torch.long), "example_index": torch.arange(4000), "epoch": 0}
    b["loss_mask"][:, :4] = 0
    coins = prepare(module, b)["coins"].float().mean()
    assert 0.22 < coins < 0.28


# ------------------------------------------------------------------------------------------------ training
def fit(tmp_path, callback, ckpt_path=None, max_steps=6):
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[callback, RunSummary(),
        L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)],
    )
    dm = data(task={"num_train": 32})
    torch.manual_seed(0)
    module = BlockDiffusionGemmaModule(
        vocab_size=dm.vocab_size, pad_token_id=dm.pad_token_id, eos_token_id=dm.eos_token_id,
        backbone={"model_config": TINY_DIFFUSION_GEMMA}, generation={"val_generate_batches": 0},
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def test_resume_continues_bit_for_bit(tmp_path):
    whole = RecordLosses()
    fit(tmp_path / "whole", whole)  # 6 steps of 4 batches an epoch: the run crosses an epoch boundary
    first = RecordLosses(stop_at=3)
    fit(tmp_path / "parts", first)
    rest = RecordLosses()
    fit(tmp_path / "parts", rest, ckpt_path=str(tmp_path / "parts" / "last.ckpt"))
    assert first.losses + rest.losses == whole.losses


def test_loss_falls_and_validation_answers_through_transformers_generate():
    """A short fit lowers the loss; validation runs transformers' DiffusionGemma generate on the model itself."""
    torch.manual_seed(0)
    dm = data(task={"num_train": 256}, loader={"batch_size": 16, "val_batch_size": 16})
    module = BlockDiffusionGemmaModule(
        vocab_size=dm.vocab_size, pad_token_id=dm.pad_token_id, eos_token_id=dm.eos_token_id,
        backbone={"model_config": TINY_DIFFUSION_GEMMA}, optimization={"lr": 3e-3},
        generation={"gen_length": 12, "gen_steps": 4},
    )
    record = RecordLosses()
    trainer = L.Trainer(max_steps=40, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=1,
                        val_check_interval=40, check_val_every_n_epoch=None, callbacks=[record])
    trainer.fit(module, dm)
    assert sum(record.losses[-5:]) < 0.7 * sum(record.losses[:5])
    metrics = trainer.callback_metrics
    assert {"val/loss", "val/masked_accuracy", "val/exact_match"} <= set(metrics)
    assert "train/ar_loss" in metrics and "train/canvas_tokens" in metrics


def test_save_pretrained_is_a_plain_transformers_checkpoint(tmp_path):
    module = gemma()
    module.save_pretrained(tmp_path)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path)
    for name, param in module.model.hf.state_dict().items():
        assert torch.equal(hf.state_dict()[name], param), name
    prompt = torch.tensor(TOK("rev 4821=")["input_ids"])
    torch.manual_seed(0)
    served = hf.generate(prompt[None], max_new_tokens=8, max_denoising_steps=4, return_dict_in_generate=False)
    module.generation, module.noise_seed = dataclasses.replace(module.generation, gen_steps=4), 0
    answer = module.generate_ids([prompt], 8)[0]
    assert torch.equal(served[0, len(prompt) : len(prompt) + len(answer)], answer)


# ------------------------------------------------------------------------------------------------ bad input
def test_data_that_is_not_a_response_window_of_whole_canvases_is_refused():
    dm = data(collation={"response_window": False})
    module = gemma().train()
    with pytest.raises(ValueError, match="not a multiple of canvas_length=4.*data.init_args.collation"):
        prepare(module, batch(dm))


@pytest.mark.parametrize(
    ("collation", "message"),
    [
        ({"pad_block_size": 8}, r"\(collation.pad_block_size=8\): set data.init_args.collation.pad_block_size: 4\."),
        ({"response_window": False}, r"set data.init_args.collation.response_window: true\."),
        ({"pad_block_size": None, "response_window": False},
         r"set data.init_args.collation.pad_block_size: 4 and data.init_args.collation.response_window: true\."),
    ],
)
def test_the_data_module_refuses_a_collation_the_module_does_not_take(collation, message):
    """Gemma states the collation it requires (whole canvases, from its config: the model is not built yet), and the
    data module's setup refuses any other, naming the setting and the module, before the model is built."""
    module = BlockDiffusionGemmaModule(vocab_size=len(TOK), backbone={"model_config": TINY_DIFFUSION_GEMMA})
    assert module.required_collation() == {"pad_block_size": BLOCK, "response_window": True} and module.model is None
    trainer = L.Trainer(accelerator="cpu", logger=False, max_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=rf"^BlockDiffusionGemmaModule requires a collation .*{message}"):
        trainer.fit(module, data(collation=collation))
    assert module.model is None


def test_the_required_canvas_length_is_read_without_building_the_model(tmp_path):
    from transformers import DiffusionGemmaConfig

    assert gemma_model.canvas_length_of(config=TINY_DIFFUSION_GEMMA) == BLOCK
    assert gemma_model.canvas_length_of(config={}) == DiffusionGemmaConfig().canvas_length == 256
    DiffusionGemmaConfig(canvas_length=8).save_pretrained(tmp_path)  # a pretrained folder: its config.json alone
    assert gemma_model.canvas_length_of(str(tmp_path)) == 8
    module = BlockDiffusionGemmaModule(vocab_size=len(TOK), backbone={"model": str(tmp_path)})
    assert module.required_collation() == {"pad_block_size": 8, "response_window": True}
    assert gemma().required_collation()["pad_block_size"] == BLOCK  # the built model's


def test_a_prompt_that_fills_the_sequence_is_refused():
    module = gemma().train()
    b = {"input_ids": torch.full((2, 8), 5), "loss_mask": torch.zeros(2, 8),
         "attention_mask": torch.ones(2, 8, dtype=torch.long), "example_index": torch.arange(2), "epoch": 0}
    b["loss_mask"][0, 4:] = 1
    with pytest.raises(ValueError, match="Row 1 has no response.*max_seq_len"):
        prepare(module, b)


def test_a_model_without_the_diffusion_gemma_layout_is_refused(tmp_path):
    CausalLMModule(vocab_size=len(TOK), backbone={"model_config": TINY_LLAMA}).save_pretrained(tmp_path)
    module = BlockDiffusionGemmaModule(vocab_size=len(TOK), backbone={"model": str(tmp_path)})
    with pytest.raises(ValueError, match="'llama' model, not a DiffusionGemma model"):
        module.configure_model()


def test_training_flex_attention_on_a_cpu_is_refused_and_its_heads_fit_cuda():
    """The shared stack's flex attention trains on CUDA only; the tiny config's heads (16 and 16) fit its kernels."""
    from lit_dllm.hub.hf import check_flex_training

    module = gemma(attention="flex_attention")
    with pytest.raises(ValueError, match="trains on CUDA GPUs only"):
        check_flex_training(module.model, None, torch.device("cpu"))  # found in the config
    check_flex_training(module.model, None, torch.device("cuda"))
    text = dict(TINY_DIFFUSION_GEMMA["text_config"], global_head_dim=8)
    narrow = gemma(attention="flex_attention", model_config=dict(TINY_DIFFUSION_GEMMA, text_config=text))
    with pytest.raises(ValueError, match=r"heads of \[8\]"):
        check_flex_training(narrow.model, None, torch.device("cuda"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"self_conditioning_p": 1.5}, "self_conditioning_p=1.5"),
        ({"encoder_loss_weight": -1.0}, "encoder_loss_weight=-1.0"),
        ({"generation": {"gen_steps": 0}}, "gen_steps=0"),
        ({"backbone": {"model_config": {"canvas_length": 4, "text_config": {"num_layers": 2}}}},
         "num_layers -> num_hidden_layers"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        module = BlockDiffusionGemmaModule(vocab_size=len(TOK),
                                           **{"backbone": {"model_config": TINY_DIFFUSION_GEMMA}, **kwargs})
        module.configure_model()
