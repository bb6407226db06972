"""DFlash draft training (DFlashModule on transformers' MuseGlimmerAssistantModel): no leakage through the real draft,
train/serve parity with transformers' speculative decoding, keyed anchors, non-overlapping blocks at every length, the
weighted-mean loss, resume, learning with lossless decoding, exports, and clear errors."""

import copy
import json

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, MuseGlimmerAssistantModel
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from lit_dllm import DLLMDataModule, build_default_tokenizer
from lit_dllm.callbacks import RunSummary
from lit_dllm.noise.keys import example_keys
from lit_dllm.families.dflash.blocks import Blocks, anchor_candidates, build_blocks, default_loss_gamma, sample_anchors
from lit_dllm.families.dflash.model import default_target_layer_ids
from lit_dllm.families.dflash.module import DFlashModule
from lit_dllm.testing import TINY_DFLASH_DRAFT, TINY_LLAMA

from tests.core.test_resume_and_errors import RecordLosses
from tests.data.test_datamodule import data_module

TOK = build_default_tokenizer()
BLOCK = 4


def data(**settings) -> DLLMDataModule:
    defaults = {"source": {"path": "task:reverse"}, "task": {"kwargs": {"min_len": 2, "max_len": 8}, "num_train": 64,
                "num_val": 8}, "loader": {"batch_size": 8}, "max_seq_len": 32,
                "collation": {"pad_seq_len_divisible": 8}}
    return data_module(defaults, **settings)


def dflash(dtype: torch.dtype = torch.float32, **kwargs) -> DFlashModule:
    """A tiny DFlash module; ``target`` and ``generation`` (dicts) update the defaults' fields."""
    torch.manual_seed(0)
    args = dict(vocab_size=len(TOK), mask_token_id=TOK.mask_token_id, pad_token_id=TOK.pad_token_id,
                eos_token_id=TOK.eos_token_id, target={"model_config": TINY_LLAMA}, draft_config=TINY_DFLASH_DRAFT,
                target_layer_ids=[0, 1], block_size=BLOCK, num_anchors=3, generation={"val_generate_batches": 0})
    groups = {name: {**args[name], **kwargs.pop(name)} for name in ("target", "generation") if name in kwargs}
    module = DFlashModule(**{**args, **kwargs, **groups})
    module.configure_model()
    return module.to(dtype)


def batch(dm: DLLMDataModule, size: int = 8, start: int = 0) -> dict:
    dm.setup("fit")
    rows = [{k: v for k, v in dm.train_dataset[i].items() if k != "length"} for i in range(start, start + size)]
    return {**dm.collator(rows), "epoch": 0}


def prepare(module, b, epoch=0):
    return module.prepare_batch(b, example_keys(42, b["example_index"], epoch))


def block_logits(module, ids, built) -> torch.Tensor:
    """Draft logits ``[B, N, bs, V]`` of every block."""
    logits = module.model.logits(module.model.hidden(ids, built))
    return logits.view(len(ids), -1, BLOCK, logits.shape[-1])


def blocks_at(anchors: list[int], ids: torch.Tensor, module) -> object:
    """One row's blocks at ``anchors`` (all kept), every token scored."""
    blocks = Blocks(torch.tensor([anchors]), torch.ones(1, len(anchors), dtype=torch.bool),
                    torch.ones(1, len(anchors), dtype=torch.long))
    return build_blocks(ids, torch.ones_like(ids, dtype=torch.bool), blocks, BLOCK, TOK.mask_token_id,
                        module.loss_gamma)


# ---------------------------------------------------------------------------------------------------- the mask
@pytest.mark.parametrize("num_anchors", [1, 3])
def test_a_block_never_sees_tokens_at_or_after_its_anchor_nor_other_blocks(num_anchors):
    """float64 eager, through the real draft: block n's logits are bit-identical when the target's tokens at or after
    its anchor change, or when another block's inputs change (overlapping blocks; N=1 is masked too,
    docs/DESIGN.md §14 (a)); a token before the anchor does change them (the context is used)."""
    module = dflash(torch.float64, attn_implementation="eager", num_anchors=num_anchors).eval()
    b = batch(data(task={"kwargs": {"min_len": 8, "max_len": 8}}))
    built = prepare(module, b)["blocks"]
    anchors, keep, _ = built.blocks
    ids = b["input_ids"]
    base = block_logits(module, ids, built)
    for n in range(num_anchors):
        rows = keep[:, n]
        changed = ids.clone()
        for row in range(len(ids)):
            start = int(anchors[row, n])
            changed[row, start:] = torch.randint(3, len(TOK), changed[row, start:].shape)
        assert torch.equal(block_logits(module, changed, built)[rows, n], base[rows, n]), n
        before = ids.clone()
        before[:, 0] = (before[:, 0] + 1) % len(TOK)
        assert not torch.equal(block_logits(module, before, built)[rows, n], base[rows, n])
    if num_anchors > 1:  # overlapping blocks do not see each other's noise
        inputs = built.block_ids.clone().view(len(ids), num_anchors, BLOCK)
        inputs[:, 1:] = torch.randint(3, len(TOK), inputs[:, 1:].shape)
        other = block_logits(module, ids, built._replace(block_ids=inputs.flatten(1)))
        assert torch.equal(other[:, 0], base[:, 0])
        assert not torch.equal(other[:, 1], base[:, 1])


# -------------------------------------------------------------------------------------------- train/serve parity
def test_training_logits_equal_transformers_speculative_decoding(monkeypatch):
    """The draft logits transformers' DFlash candidate generator computes at each step (its KV cache, cropped context,
    positions) equal the training forward's for the same anchors, all blocks in one masked forward: within 1e-5."""
    module = dflash().eval()
    served = []
    original = DFlashTokenCandidateGenerator.get_candidates

    def spy(self, input_ids, **kwargs):
        candidates, logits = original(self, input_ids, **kwargs)
        if logits is not None:
            served.append((input_ids.shape[1] - 1, logits[0]))  # anchor = the last committed token
        return candidates, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", spy)
    prompt = torch.tensor(TOK("rev 48213=")["input_ids"])
    decoded = module.speculative_decode(prompt, 12)
    assert len(served) >= 3 and torch.equal(decoded.tokens, module.target_generate(prompt, 12))
    sequence = torch.cat([prompt, decoded.tokens])[None]
    built = blocks_at([anchor for anchor, _ in served], sequence, module)
    trained = block_logits(module, sequence, built)[0, :, 1:]
    for n, (_, logits) in enumerate(served):
        torch.testing.assert_close(trained[n], logits, rtol=1e-5, atol=1e-5)


def test_flex_attention_block_mask_gives_the_dense_masks_draft_outputs():
    """attn_implementation=flex_attention (the GPU path: a BlockMask instead of a dense mask) through the real draft in
    training mode, forward on the CPU: the same hidden states as sdpa with the dense mask (transformers compiles flex:
    ~15 s)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    dense = dflash()
    flex = dflash(attn_implementation="flex_attention")
    flex.model.draft.load_state_dict(dense.model.draft.state_dict())
    b = batch(data(task={"kwargs": {"min_len": 8, "max_len": 8}}))
    built = prepare(dense, b)["blocks"]
    with torch.no_grad():
        torch.testing.assert_close(flex.model.hidden(b["input_ids"], built), dense.model.hidden(b["input_ids"], built),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loaded", [False, True])
def test_a_flex_draft_attends_with_flex_in_training_and_with_sdpa_in_evaluation_and_decoding(loaded, tmp_path):
    """attn_implementation=flex_attention is for training: module.eval() (validation, generation) switches the draft to
    sdpa with the dense mask, module.train() back to flex; a draft loaded from disk (in eval mode) starts on sdpa."""
    from torch.nn.attention.flex_attention import BlockMask

    kwargs: dict = {}
    if loaded:
        dflash().model.draft.save_pretrained(tmp_path)
        kwargs = {"draft": str(tmp_path), "draft_config": None}
    module = dflash(attn_implementation="flex_attention", **kwargs)
    assert module.model.draft.config._attn_implementation == ("sdpa" if loaded else "flex_attention")
    blocks = prepare(module, batch(data()))["blocks"].blocks
    for training in (False, True, False):
        module.train(training)
        assert module.model.draft.config._attn_implementation == ("flex_attention" if training else "sdpa")
        mask = module.model.attention_mask(blocks, 32, torch.float32)["full_attention"]
        assert isinstance(mask, BlockMask) == training and (training or mask.dtype == torch.bool)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's compiled backward is checked on a GPU")
def test_flex_attention_backward_gives_the_dense_masks_gradients_on_gpu():
    """fp32 on a GPU: the training loss and every draft gradient through flex attention's BlockMask (its compiled
    backward) equal those through sdpa's dense mask (relative norm difference < 1e-4). Heads of 16 dims: the smallest
    tile of flex's Triton kernels."""
    draft = {**TINY_DFLASH_DRAFT, "head_dim": 16}
    dense = dflash(draft_config=draft).cuda()
    flex = dflash(draft_config=draft, attn_implementation="flex_attention").cuda()
    flex.model.draft.load_state_dict(dense.model.draft.state_dict())
    b = batch(data(task={"kwargs": {"min_len": 8, "max_len": 8}}))
    b = {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}
    losses = []
    for module in (dense, flex):
        prepared = prepare(module, b)
        total = module.token_counts(b, prepared)["weighted_targets"]
        loss = module.compute_loss(b, prepared, {"weighted_targets": total}).output.total_loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    pairs = zip(dense.model.draft.named_parameters(), flex.model.draft.parameters())
    differences = {name: float((got.grad - expected.grad).norm() / expected.grad.norm()) for (name, expected), got in pairs}
    worst = max(differences, key=differences.get)
    print(f"flex vs sdpa draft gradients: largest relative norm difference {differences[worst]:.2e} ({worst})")
    assert differences[worst] < 1e-4, differences


# ------------------------------------------------------------------------------------------------ anchors
@pytest.mark.parametrize("overlap", [True, False])
def test_anchors_are_keyed_by_example_not_by_batch_and_change_with_the_epoch(overlap):
    module = dflash(overlap_anchors=overlap)
    b = batch(data(), size=8)
    whole = prepare(module, b)["blocks"]
    halves = [prepare(module, {k: (v[s] if torch.is_tensor(v) else v) for k, v in b.items()})["blocks"]
              for s in (slice(0, 3), slice(3, 8))]
    for field in ("anchors", "keep"):
        joined = torch.cat([getattr(h.blocks, field) for h in halves])
        assert torch.equal(getattr(whole.blocks, field), joined)
    later = prepare(module, b, epoch=1)["blocks"]
    assert not torch.equal(later.blocks.anchors, whole.blocks.anchors)
    # every kept anchor is a response token (never position 0)
    scored = b["loss_mask"].bool()
    anchors, keep, _ = whole.blocks
    assert bool(scored.gather(1, anchors)[keep].all()) and int(anchors[keep].min()) >= 1


def test_global_normalisation_splits_exactly():
    """Micro-batches normalised by the global weighted count sum to the whole batch's loss (accumulation / DDP)."""
    module = dflash()
    b = batch(data(), size=8)
    parts = [{k: (v[s] if torch.is_tensor(v) else v) for k, v in b.items()} for s in (slice(0, 3), slice(3, 8))]
    prepared = [prepare(module, p) for p in (b, *parts)]
    total = module.token_counts(b, prepared[0])["weighted_targets"]
    whole = module.compute_loss(b, prepared[0], {"weighted_targets": total}).output.total_loss
    split = sum(module.compute_loss(p, q, {"weighted_targets": total}).output.total_loss
                for p, q in zip(parts, prepared[1:]))
    torch.testing.assert_close(whole, split)


def test_non_overlapping_blocks_at_every_length():
    """Disjoint blocks inside the candidates' span for every span length, the reference's crash case included
    (min valid length 50, block 16, 3 blocks: 1 < avail < n, docs/DESIGN.md §14 (b))."""
    keys = example_keys(0, torch.arange(64))
    for block, num in ((4, 3), (16, 3), (2, 5)):
        for length in range(1, 60):
            candidates = torch.zeros(64, 64, dtype=torch.bool)
            candidates[:, 1:length] = True
            anchors, keep, _ = sample_anchors(candidates, keys, num, block, overlap=False)
            span = max(length - 2, 0)
            expected = min(num, span // block + 1) if length > 1 else 0
            assert torch.equal(keep.sum(1), torch.full((64,), expected))
            if expected:
                kept = anchors[:, :expected]
                assert bool((kept >= 1).all() and (kept <= length - 1).all())
                assert bool((kept.diff(dim=1) >= block).all())


def test_candidates_are_response_tokens_with_a_scored_successor_in_the_block():
    scored = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    expected = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(anchor_candidates(scored, 3), expected)
    expected[1, 1] = False  # position 0 never anchors; 1 sees 7 only with a block of 7
    assert torch.equal(anchor_candidates(scored, 7)[1], torch.tensor([0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------- the loss
def test_loss_is_the_decay_weighted_mean_and_metrics_are_hand_checked():
    """loss = Σ w·nll / Σ w over the scored targets (not Σ w·nll / count, docs/DESIGN.md §14 (f)),
    w = exp(-(k-1)/γ), computed here from the full draft logits; the accept length counts leading hits per block
    (+1)."""
    module = dflash(loss_decay_gamma=2.0)
    b = batch(data())
    prepared = prepare(module, b)
    built = prepared["blocks"]
    count = module.token_counts(b, prepared)["weighted_targets"]
    step = module.compute_loss(b, prepared, {"weighted_targets": count})
    logits = block_logits(module, b["input_ids"], built)[:, :, 1:].flatten(1, 2)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), built.targets, reduction="none")
    weights = torch.exp(-torch.arange(BLOCK - 1) / 2.0).repeat(built.targets.shape[1] // (BLOCK - 1))
    mask = built.scored.float()
    expected = (nll * weights * mask).sum() / (weights * mask).sum()
    torch.testing.assert_close(step.output.total_loss, expected)
    assert default_loss_gamma(16) == 7 and default_loss_gamma(8) == 4 and default_loss_gamma(12) == 6
    assert default_loss_gamma(3) == 2
    hits = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool).view(1, -1)
    scored = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]], dtype=torch.bool).view(1, -1)
    fake = built._replace(scored=scored, weights=scored.float())
    stats = module._block_stats(hits, fake)
    assert stats[:3].tolist() == [2, 1, 1] and stats[3:6].tolist() == [2, 1, 2]
    assert stats[6:8].tolist() == [(2 + 1) + (2 + 1), 2]  # block 2: hit, unscored (counts, adds 0), hit


def test_variable_prefix_mode_scores_offsets_after_the_prefix():
    module = dflash(loss_type="variable_prefix", block_size=6, loss_decay_gamma=3.0)
    b = batch(data(task={"kwargs": {"min_len": 8, "max_len": 8}}))
    built = prepare(module, b)["blocks"]
    prefix = built.blocks.prefix
    assert bool(((prefix >= 2) & (prefix <= 5)).all())
    offsets = torch.arange(1, 6)
    scored = built.scored.view(len(prefix), -1, 5)
    assert not bool((scored & (offsets < prefix[:, :, None])).any())
    ids = built.block_ids.view(len(prefix), -1, 6)
    real = torch.arange(6) < prefix[:, :, None]
    assert bool((ids[~real & built.blocks.keep[:, :, None]] == TOK.mask_token_id).all())
    weights = built.weights.view_as(scored)
    expected = torch.exp(-(offsets - prefix[:, :, None]).float() / 3.0)
    torch.testing.assert_close(weights[scored], expected[scored])
    assert torch.isfinite(module.compute_loss(b, {"blocks": built}, {"weighted_targets": weights.sum()}).output.total_loss)


def test_default_target_layer_ids_round_half_to_even():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(11, 3) == [1, 4, 8]  # 4.5 rounds to 4, as Python does (half-up would give 5)
    assert default_target_layer_ids(2, 1) == [1]


# -------------------------------------------------------------------------------------------- training runs
def trainer(tmp_path, callbacks, **kwargs):
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=tmp_path, callbacks=callbacks, **kwargs)


def test_resume_continues_bit_for_bit_and_the_target_stays_out_of_checkpoints(tmp_path):
    def fit(folder, callback, ckpt_path=None):
        saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=1)
        t = trainer(folder, [callback, RunSummary(), saver], max_steps=5, limit_val_batches=0)
        dm = data()
        t.fit(dflash(), dm, ckpt_path=ckpt_path)

    whole = RecordLosses()
    fit(tmp_path / "whole", whole)
    first, rest = RecordLosses(stop_at=2), RecordLosses()
    fit(tmp_path / "parts", first)
    fit(tmp_path / "parts", rest, ckpt_path=str(tmp_path / "parts" / "last.ckpt"))
    assert first.losses + rest.losses == whole.losses
    state = torch.load(tmp_path / "parts" / "last.ckpt", weights_only=False)["state_dict"]
    assert state and not any(key.startswith("model.target.") for key in state)


def test_the_draft_learns_and_speculative_decoding_stays_lossless(tmp_path):
    """A short run: the loss falls; validation decodes with transformers' DFlash speculative decoding, and its greedy
    output equals the target's own greedy output on every prompt (also for a barely trained draft). The random
    target's weights are drawn wide (initializer_range 0.3) so that its frozen LM head can express peaked logits."""
    dm = data(loader={"batch_size": 16, "val_batch_size": 4}, task={"num_train": 2000, "num_val": 4})
    module = dflash(target={"model_config": {**TINY_LLAMA, "initializer_range": 0.3}}, optimization={"lr": 1e-2},
                    generation={"val_generate_batches": 1, "gen_length": 6})
    losses = RecordLosses()
    t = trainer(tmp_path, [losses], max_steps=30, val_check_interval=30, num_sanity_val_steps=0)
    t.fit(module, dm)
    assert sum(losses.losses[-5:]) / 5 < 0.7 * sum(losses.losses[:3]) / 3
    metrics = t.callback_metrics
    assert float(metrics["val/greedy_identical"]) == 1.0
    assert 1.0 <= float(metrics["val/accept_len"]) <= BLOCK and float(metrics["val/accept_len_sampled"]) >= 1.0
    assert float(metrics["train/empty_microbatches"]) == 0 and "train/acc_k3" in metrics


def test_bf16_speculative_greedy_departs_from_the_targets_greedy_only_at_near_ties():
    """In float32, speculative greedy decoding gives the target's greedy answer exactly. In bfloat16 the target
    verifies a block per forward, whose matmuls round differently from one-token forwards: an answer may depart, but
    only where the two tokens' float32 logits are closer than bfloat16 computes logits there: within twice the bf16
    target's largest logit error at that position (its forward over the context against float32's; the cached
    one-token and block forwards round differently again), or one bf16 step of the logit where that is larger.
    (One step alone, this test's earlier bound, failed on an AMD EPYC CPU: a gap of 0.046 where bf16 errs by 0.059.)"""
    for dtype in (torch.float32, torch.bfloat16):
        module = dflash(dtype, target={"model_config": {**TINY_LLAMA, "initializer_range": 0.3}}).eval()
        exact = copy.deepcopy(module.model.target).float()  # the same (rounded) weights, computed in float32
        for seed in range(10):
            prompt = torch.randint(5, len(TOK), (12,), generator=torch.Generator().manual_seed(seed))
            plain, spec = module.target_generate(prompt, 64), module.speculative_decode(prompt, 64).tokens
            if torch.equal(plain, spec):
                continue
            assert dtype == torch.bfloat16, f"float32 answers differ for prompt {seed}"
            first = int((plain[: len(spec)] != spec[: len(plain)]).nonzero()[0, 0])
            context, pair = torch.cat([prompt, plain[:first]])[None], [int(plain[first]), int(spec[first])]
            with torch.no_grad():
                logits = exact(context).logits[0, -1]
                error = (module.model.target(context).logits[0, -1].float() - logits).abs().max()
            chosen = logits[pair]
            bound = max(2 * float(error), 2**-7 * float(chosen.abs().max()))
            assert float((chosen[0] - chosen[1]).abs()) <= bound, (seed, chosen, float(error))


def test_no_valid_anchor_gives_a_zero_loss_that_keeps_the_graph_and_skips_the_step(tmp_path):
    module = dflash()
    b = batch(data())
    b["loss_mask"] = torch.zeros_like(b["loss_mask"])
    prepared = prepare(module, b)
    assert not bool(prepared["blocks"].blocks.keep.any())
    step = module.compute_loss(b, prepared, {"weighted_targets": torch.tensor(1.0)})
    step.output.total_loss.backward()
    draft = [p for p in module.model.draft.parameters()]
    assert float(step.output.total_loss) == 0 and all(p.grad is not None and not p.grad.any() for p in draft)

    class Empty(L.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader([b, b], batch_size=None)

    fresh = dflash()
    before = {k: v.clone() for k, v in fresh.model.draft.state_dict().items()}
    t = trainer(tmp_path, [], max_steps=2, limit_val_batches=0)
    t.fit(fresh, Empty())
    assert float(t.callback_metrics["train/empty_microbatches"]) == 1
    assert all(torch.equal(before[k], v) for k, v in fresh.model.draft.state_dict().items())


class PerRankBatches(L.LightningDataModule):
    """Rank r trains on ``batches[r]`` at every step (no distributed sampler)."""

    def __init__(self, *batches):
        super().__init__()
        self.batches = batches

    def train_dataloader(self):
        rank = self.trainer.global_rank if self.trainer is not None else 0
        return torch.utils.data.DataLoader([self.batches[rank]] * 3, batch_size=None)


def test_a_rank_without_anchors_neither_hangs_nor_changes_the_step(tmp_path):
    """DDP on 2 gloo processes, rank 1's batches without any valid anchor: no hang, and the draft ends where one
    process training on rank 0's batches alone ends (the empty rank adds nothing to the global weighted mean)."""
    good = batch(data(), size=4)
    empty = {**good, "loss_mask": torch.zeros_like(good["loss_mask"]), "example_index": good["example_index"] + 100}
    alone = dflash(optimization={"lr": 1e-2})
    trainer(tmp_path / "one", [], max_steps=3, limit_val_batches=0).fit(alone, PerRankBatches(good))
    ddp = dflash(optimization={"lr": 1e-2})
    t = trainer(tmp_path / "ddp", [], max_steps=3, limit_val_batches=0, strategy="ddp_spawn", devices=2,
                use_distributed_sampler=False)
    t.fit(ddp, PerRankBatches(good, empty))
    assert float(t.callback_metrics["train/empty_microbatches"]) == 1
    for key, value in alone.model.draft.state_dict().items():
        torch.testing.assert_close(ddp.model.draft.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_rows_shorter_than_a_block_train_on_their_own_tokens():
    """A 6-token row with blocks of 8: anchors 1..4 (each with a token after it), each block scoring only the
    in-bounds targets a+1..5 (at the end of an answer serving drafts such partial blocks too)."""
    module = dflash(block_size=8)
    ids = torch.tensor([[5, 9, 12, 7, 30, 1]])
    b = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids),
         "input_lengths": torch.tensor([6]), "example_index": torch.tensor([0]), "epoch": 0}
    built = prepare(module, b)["blocks"]
    anchors, keep, _ = built.blocks
    assert bool(keep.all()) and set(anchors[0].tolist()) <= {1, 2, 3, 4}
    scored = built.scored.view(1, -1, 7)
    for n, anchor in enumerate(anchors[0].tolist()):
        assert scored[0, n].tolist() == [k <= 5 - anchor for k in range(1, 8)]
        assert built.targets.view(1, -1, 7)[0, n, : 5 - anchor].tolist() == ids[0, anchor + 1 :].tolist()
    loss = module.compute_loss(b, {"blocks": built}, {"weighted_targets": built.weights.sum()}).output.total_loss
    assert torch.isfinite(loss) and loss > 0


def test_a_bf16_target_trains_an_fp32_draft_and_decodes():
    """torch_dtype=bfloat16 loads the frozen target in bf16; the draft's weights and gradients stay fp32, and
    speculative decoding (autocast to the target's dtype) still equals the target's own greedy output."""
    torch.manual_seed(0)
    module = DFlashModule(vocab_size=len(TOK), mask_token_id=TOK.mask_token_id, pad_token_id=TOK.pad_token_id,
                          eos_token_id=TOK.eos_token_id, target={"model_config": TINY_LLAMA, "torch_dtype": "bfloat16"},
                          draft_config=TINY_DFLASH_DRAFT, target_layer_ids=[0, 1], block_size=BLOCK, num_anchors=3)
    module.configure_model()
    assert next(module.model.target.parameters()).dtype == torch.bfloat16
    b = batch(data())
    prepared = prepare(module, b)
    loss = module.compute_loss(b, prepared, module.token_counts(b, prepared)).output.total_loss
    loss.backward()
    assert torch.isfinite(loss) and module.model.draft.norm.weight.grad.dtype == torch.float32
    prompt = torch.tensor(TOK("rev 4913=")["input_ids"])
    assert torch.equal(module.speculative_decode(prompt, 6).tokens, module.target_generate(prompt, 6))


# ------------------------------------------------------------------------------------------------------ export
def test_exports_reload_and_serve(tmp_path):
    module = dflash().eval()
    prompt = torch.tensor(TOK("rev 5120=")["input_ids"])
    decoded = module.speculative_decode(prompt, 10)
    module.save_pretrained(tmp_path / "hf")
    draft = AutoModel.from_pretrained(tmp_path / "hf")
    assert isinstance(draft, MuseGlimmerAssistantModel) and draft.config.block_size == BLOCK
    steps = []
    original = DFlashTokenCandidateGenerator.update_candidate_strategy

    def count(self, input_ids, scores, num_matches):
        steps.append(int(num_matches) + 1)
        return original(self, input_ids, scores, num_matches)

    DFlashTokenCandidateGenerator.update_candidate_strategy = count
    try:
        ids = prompt[None]
        out = module.model.target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                                           speculation_type="dflash", max_new_tokens=10, do_sample=False,
                                           eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    finally:
        DFlashTokenCandidateGenerator.update_candidate_strategy = original
    assert torch.equal(out[0, len(prompt):], decoded.tokens)
    assert steps[1:] == decoded.accepted  # the τ transformers' decoding reports is the module's
    module.export_zlab(tmp_path / "zlab")
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"block_size": BLOCK, "mask_token_id": TOK.mask_token_id, "target_layer_ids": [0, 1]}
    assert config["is_causal"] is False and config["num_target_layers"] == 2
    keys = set(load_file(tmp_path / "zlab" / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= keys
    assert not any(key.startswith("encoder.") for key in keys)
    reloaded = dflash(draft=str(tmp_path / "zlab"), draft_config=None)
    for key, value in module.model.draft.state_dict().items():
        assert torch.equal(reloaded.model.draft.state_dict()[key], value), key


# ------------------------------------------------------------------------------------------------- bad input
def test_flex_attention_is_refused_before_the_first_step_where_it_cannot_train(tmp_path):
    """On a CPU (no FlexAttention backward) the fit stops at its start; on CUDA, heads under 16 dims (the Triton
    kernels' smallest) are named; the frozen target's attention is not the draft's concern."""
    from lit_dllm.hub.hf import check_flex_training

    module = dflash(attn_implementation="flex_attention")
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="flex_attention' trains on CUDA GPUs only .* set attn_implementation: sdpa"):
        trainer.fit(module, data())
    assert trainer.global_step == 0
    with pytest.raises(ValueError, match=r"at least 16 dims on CUDA .* heads of \[8\]: set attn_implementation: sdpa"):
        check_flex_training(module.model, "flex_attention", torch.device("cuda"))
    wide = dflash(attn_implementation="flex_attention", draft_config={**TINY_DFLASH_DRAFT, "head_dim": 16})
    check_flex_training(wide.model, "flex_attention", torch.device("cuda"))
    check_flex_training(dflash().model, "sdpa", torch.device("cpu"))


def test_bad_input_is_reported_clearly(tmp_path):
    with pytest.raises(ValueError, match="hidden size"):
        dflash(draft_config={"hidden_size": 64})
    dflash().save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match=r"draft's hidden size \(32\) differs from the target's \(64\)"):
        dflash(target={"model_config": {**TINY_LLAMA, "hidden_size": 64}}, draft=str(tmp_path / "draft"),
               draft_config=None)
    with pytest.raises(ValueError, match="block_size 4"):
        dflash(draft=str(tmp_path / "draft"), draft_config=None, block_size=8)
    with pytest.raises(ValueError, match="mask_token_id=200 is outside the vocabulary \\[0, "):
        dflash(mask_token_id=200)
    with pytest.raises(ValueError, match=r"out of range: \[5\]"):
        dflash(target_layer_ids=[0, 5])
    with pytest.raises(ValueError, match="default formula"):
        dflash(target_layer_ids=None, draft_config={"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="mask_token_id is None"):
        DFlashModule(vocab_size=10, target={"model_config": TINY_LLAMA})
    with pytest.raises(ValueError, match="mask_token_id=1 is also the eos token's id"):
        dflash(mask_token_id=TOK.eos_token_id)
    with pytest.raises(ValueError, match="exactly one of target"):
        DFlashModule(vocab_size=10, mask_token_id=2)
    dflash().model.target.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="'llama' model, not a DFlash draft"):
        dflash(draft=str(tmp_path / "llama"), draft_config=None)
    with pytest.raises(OSError, match="Could not load a DFlash draft from .*DFlashModule.save_pretrained"):
        dflash(draft=str(tmp_path / "missing"), draft_config=None)
    with pytest.raises(ValueError, match="block_size=1"):
        DFlashModule(vocab_size=10, mask_token_id=2, target={"model_config": TINY_LLAMA}, block_size=1)


def test_the_cli_keeps_the_target_frozen_and_out_of_checkpoints(tmp_path):
    """Through LightningCLI (whose parsed config, frozen_modules: null, becomes the hyper-parameters): the target's
    weights stay as built and stay out of the checkpoint."""
    from lit_dllm.cli import main

    target = json.dumps(TINY_LLAMA)
    cli = main(["fit", "--config", "configs/dflash_tiny.yaml", "--model.init_args.target.model=null",
                f"--model.init_args.target.model_config={target}", "--model.init_args.draft_config={num_hidden_layers: 1}",
                "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.task.num_train=128",
                "--data.init_args.task.num_val=8", "--data.init_args.loader.batch_size=8"])
    module = cli.model
    assert module.hparams.frozen_modules == ["model.target"]
    built = dflash(block_size=8, target_layer_ids=[0, 1]).model.target.state_dict()
    assert all(torch.equal(value, built[key]) for key, value in module.model.target.state_dict().items())
    checkpoint = torch.load(next((tmp_path / "dflash_tiny" / "checkpoints").glob("last*.ckpt")), weights_only=False)
    assert not any(key.startswith("model.target.") for key in checkpoint["state_dict"])
    assert checkpoint["hyper_parameters"]["frozen_modules"] == ["model.target"]


# ------------------------------------------------------------------------------------------------- target identity
def fit_draft(target, save_dir, *extra: str):
    from lit_dllm.cli import main

    return main(["fit", *draft_args(target, save_dir), "--trainer.max_steps=2", *extra])


def draft_args(target, save_dir) -> list[str]:
    return ["--config", "configs/dflash_tiny.yaml", f"--model.init_args.target.model={target}",
            "--model.init_args.draft_config={num_hidden_layers: 1}", "--trainer.limit_val_batches=1",
            "--model.init_args.generation.val_generate_batches=0", "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={save_dir}", "--data.init_args.task.num_train=128",
            "--data.init_args.task.num_val=8", "--data.init_args.loader.batch_size=8"]


def test_a_draft_refuses_a_target_whose_weights_changed_at_the_same_path(tmp_path):
    """The checkpoint records the target's config, vocabulary and a weights fingerprint; train.py validate against a
    target retrained in place stops before scoring (the draft's val loss went 1.77 -> 4.73 without a word)."""
    from transformers import AutoModelForCausalLM

    from tests.test_cli import train_py
    from tests.test_regenerate import tiny_pretrained

    target = tmp_path / "target"
    tiny_pretrained(target)
    fit_draft(target, tmp_path)
    checkpoint = torch.load(tmp_path / "dflash_tiny" / "checkpoints" / "last.ckpt", weights_only=False)
    assert set(checkpoint["lit_dllm_dflash_target"]) == {"config", "vocabulary", "weights"}
    retrained = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        retrained.model.layers[0].mlp.up_proj.weight.add_(0.01)
    retrained.save_pretrained(target)
    result = train_py("validate", *draft_args(target, tmp_path), "--ckpt_path", "last")
    assert result.returncode != 0, result.stdout[-2000:]
    assert "was trained against another target" in result.stdout and "weights fingerprint" in result.stdout
    assert "val/loss" not in result.stdout


def test_a_data_tokenizer_other_than_the_targets_is_refused(tmp_path):
    from tests.test_regenerate import tiny_pretrained

    target, other = tmp_path / "target", tmp_path / "other"
    tiny_pretrained(target)
    build_default_tokenizer(other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"data tokenizer .* differs from the target's .* 2 tokens .* '1'"):
        fit_draft(target, tmp_path, f"--data.init_args.tokenizer.name={other}")


def test_an_export_into_a_folder_of_yours_is_refused_unless_overwrite(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    module = dflash()
    for export in (module.save_pretrained, module.export_zlab):
        with pytest.raises(ValueError, match="config.json"):
            export(tmp_path / "mine")
        assert (tmp_path / "mine" / "config.json").read_text() == "{}"
    module.save_pretrained(tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "lit_dllm_export.json").is_file()
