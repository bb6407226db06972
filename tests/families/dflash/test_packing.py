"""DFlash on packed rows: a document sees only itself (the target's features and the draft's blocks), its blocks stay
inside it, and a packed batch's loss and draft gradients are those of its documents run alone, with the same keys."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.packing import PackedCollator, pack_documents
from lit_dllm.families.dflash.masks import create_dflash_attention_mask
from lit_dllm.families.dflash.module import DFlashModule
from lit_dllm.settings import CausalBackbone
from lit_dllm.testing import TINY_DFLASH_DRAFT, TINY_LLAMA

VOCAB, MASK, PAD, EOS = 40, 39, 0, 1
LENGTHS = [[9, 5, 3], [13, 2], [6, 6, 4]]  # three packed rows of documents
PACK, BLOCK = 24, 4


def documents(lengths=LENGTHS, seed=0):
    """Rows of prompt/response documents (a prompt of at least one token) with distinct example indices."""
    g = torch.Generator().manual_seed(seed)
    rows, index = [], 0
    for row in lengths:
        docs = []
        for length in row:
            ids = torch.randint(2, MASK, (length,), generator=g)
            loss_mask = torch.zeros(length)
            loss_mask[int(torch.randint(1, max(2, length - 1), (1,), generator=g)):] = 1.0
            docs.append({"input_ids": ids, "loss_mask": loss_mask, "example_index": 100 + index})
            index += 1
        rows.append(docs)
    return rows


def dflash(build=True, **kwargs) -> DFlashModule:
    """A tiny fp32 DFlash module, target and draft eager."""
    torch.manual_seed(0)
    args = dict(vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS,
                target=CausalBackbone(model_config=dict(TINY_LLAMA), attn_implementation="eager"),
                draft_config=dict(TINY_DFLASH_DRAFT), target_layer_ids=[0, 1], block_size=BLOCK, num_anchors=3,
                attn_implementation="eager", generation={"val_generate_batches": 0})
    module = DFlashModule(**{**args, **kwargs})
    if build:
        module.configure_model()
    return module


def collators(block_size=None, pack=PACK):
    collator = DLLMCollator(pad_token_id=PAD, eos_token_id=EOS, block_size=block_size)
    return collator, PackedCollator(collator, pack)


def prepare(module, batch, epoch=3):
    return module.prepare_batch(batch, module.noise_keys(batch, epoch=epoch))["blocks"]


def in_document(batch, d, values):
    """The positions of document ``d`` in a packed ``[R, P, ...]`` tensor, in order."""
    return values[batch["document_ids"] == d]


def block_logits(module, batch, built):
    """The draft's logits ``[B, N, bs, V]`` of every block."""
    logits = module.model.logits(module.model.hidden(batch["input_ids"], built))
    return logits.view(len(batch["input_ids"]), -1, module.block_size, logits.shape[-1])


def features(module, batch, built, positions=None):
    """The target's features ``[R, P, n·H]`` at the blocks' context positions (or at ``positions``)."""
    ids = batch["input_ids"]
    return module.model.features(ids, built.document_ids, built.positions[:, : ids.shape[1]] if positions is None
                                 else positions)


def blocks_of(batch, built, d):
    """Document ``d``'s kept blocks: their slots ``(row, n)`` and anchors within the document."""
    anchors, keep, _ = built.blocks
    owner = batch["document_ids"].gather(1, anchors)
    slots = (keep & (owner == d)).nonzero(as_tuple=True)
    return slots, anchors[slots] - batch["document_offsets"][d] % batch["input_ids"].shape[1]


# ---------------------------------------------------------------------------------------------------- no leakage
def test_a_document_sees_only_itself():
    """fp32 eager: for each document in turn, every other document of the batch changes (same lengths, so the same
    anchors): the target's features at its positions and the draft's logits of its blocks do not move (exactly), and
    its features equal its features alone (positions restart per document). Keeping each document in turn covers the
    leak that matters for a causal target and a draft that looks before its anchor: from the documents before it. The
    target's document mask keeps them apart by itself, also at positions that do not restart (transformers would
    otherwise infer documents from restarting positions alone)."""
    module = dflash().eval()
    plain, packed = collators()
    rows = documents()
    flat = [doc for row in rows for doc in row]
    batch = packed(rows)
    built = prepare(module, batch)
    assert torch.equal(built.positions[:, :PACK], batch["position_ids"])  # the target's and the draft's context
    row_positions = torch.arange(PACK).expand(len(rows), -1)
    with torch.no_grad():
        base_features, base_logits = features(module, batch, built), block_logits(module, batch, built)
        base_row = features(module, batch, built, row_positions)
        for d, doc in enumerate(flat):
            changed = packed([[other if other is doc else {**other, "input_ids": (other["input_ids"] + 7) % 30 + 2}
                               for other in row] for row in rows])
            moved = prepare(module, changed)
            assert torch.equal(moved.blocks.anchors, built.blocks.anchors)  # anchors follow the loss masks only
            after_features, after_logits = features(module, changed, moved), block_logits(module, changed, moved)
            assert not torch.equal(after_features, base_features)  # the other documents did change
            assert torch.equal(in_document(batch, d, after_features), in_document(batch, d, base_features)), d
            after_row = features(module, changed, moved, row_positions)
            assert torch.equal(in_document(batch, d, after_row), in_document(batch, d, base_row)), d
            slots, _ = blocks_of(batch, built, d)
            assert torch.equal(after_logits[slots], base_logits[slots]), d
            alone = plain([doc])
            alone_features = features(module, alone, prepare(module, alone))[0, : int(batch["document_spans"][d])]
            torch.testing.assert_close(in_document(batch, d, base_features), alone_features, rtol=1e-5, atol=1e-5)
    assert sum(len(blocks_of(batch, built, d)[1]) for d in range(len(flat))) > 0


# ----------------------------------------------------------------------------------------------------- identity
def loss_and_grads(module, batch, denominators=None):
    module.zero_grad()
    prepared = module.prepare_batch(batch, module.noise_keys(batch, epoch=3))
    counts = {name: value.float() for name, value in module.token_counts(batch, prepared).items()}
    step = module.compute_loss(batch, prepared, denominators or counts)
    step.output.total_loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return float(step.output.total_loss.detach()), grads, counts, module._last_stats, prepared["blocks"]


@pytest.mark.parametrize("loss_type, overlap, block_fill, attention", [
    ("dflash", True, None, "eager"),
    ("dflash", False, BLOCK, "sdpa"),
    ("variable_prefix", True, BLOCK, "eager"),
])
def test_packed_loss_and_gradients_equal_the_documents_alone(loss_type, overlap, block_fill, attention):
    """The packed loss, every draft gradient and the logged sums (per-offset hits and targets, simulated accept lengths,
    weighted targets) equal the sums over the documents run alone (``DLLMCollator([doc])``, the same keys) under the
    packed denominators; each document's anchors are the ones it draws alone."""
    module = dflash(loss_type=loss_type, overlap_anchors=overlap, attn_implementation=attention)
    module.model.target.set_attn_implementation(attention)
    plain, packed = collators(block_fill)
    rows = documents()
    batch = packed(rows)
    loss, grads, counts, stats, built = loss_and_grads(module, batch)
    assert int(built.scored.sum()) > 0 and grads
    alone_loss, alone_grads, alone_counts, alone_stats = 0.0, {}, {}, 0
    for d, doc in enumerate(document for row in rows for document in row):
        one, one_grads, one_counts, one_stats, one_built = loss_and_grads(module, plain([doc]), denominators=counts)
        anchors, keep, _ = one_built.blocks
        assert torch.equal(blocks_of(batch, built, d)[1], anchors[keep])
        alone_loss += one
        alone_grads = {n: alone_grads.get(n, 0) + g for n, g in one_grads.items()}
        alone_counts = {n: alone_counts.get(n, 0) + c for n, c in one_counts.items()}
        alone_stats = alone_stats + one_stats
    torch.testing.assert_close(alone_counts, counts)
    torch.testing.assert_close(stats[:-1], alone_stats[:-1], rtol=0, atol=1e-5)  # the last: "nothing scored", a flag
    difference = abs(loss - alone_loss)
    worst = max(float((g - alone_grads[n]).abs().max()) for n, g in grads.items())
    print(f"{loss_type}/{attention}: packed loss {loss:.7f}, documents alone {alone_loss:.7f} (|diff| "
          f"{difference:.1e}); largest gradient difference {worst:.1e}")
    assert difference <= 1e-5
    assert grads.keys() == alone_grads.keys() and all(n.startswith("model.draft.") for n in grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, alone_grads[n], rtol=1e-4, atol=1e-5, msg=n)


# ------------------------------------------------------------------------------------------------------- blocks
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 14), min_size=1, max_size=12), st.integers(2, 6), st.integers(1, 4), st.booleans(),
       st.booleans(), st.integers(0, 10_000))
def test_blocks_never_cross_a_document_boundary(lengths, block_size, num_anchors, overlap, fill, seed):
    """Random packings: every kept block is anchored on a scored token (not the first) of one document, at that
    document's position; its real inputs and its scored targets lie in that document, at most ``bs - 1`` past the
    anchor; the draft's mask shows it only its document's features before the anchor; and each document draws the
    anchors it draws alone.

    A block may run past its document's end, as it runs past a row's end unpacked (docs/DESIGN.md §10.2): its offsets
    there are MASK inputs with no target, so nothing of the next document enters it. The reference instead drops
    anchors with fewer than ``bs - 1`` tokens left in their document (its unpacked rule, ``a <= S - bs``, per
    document); that would lose every block of an answer shorter than the block and break the identity with the
    document alone."""
    module = dflash(build=False, block_size=block_size, num_anchors=num_anchors, overlap_anchors=overlap,
                    loss_type="variable_prefix")
    plain, packed = collators(block_size if fill else None, pack=PACK)
    g = torch.Generator().manual_seed(seed)
    flat = [doc for row in documents([lengths], seed) for doc in row]
    spans = [packed.span(len(doc["input_ids"])) for doc in flat]
    order = torch.randperm(len(flat), generator=g).tolist()
    rows = [[flat[order[i]] for i in row] for row in pack_documents([spans[i] for i in order], PACK)]
    flat = [doc for row in rows for doc in row]
    batch = packed(rows)
    built = prepare(module, batch)
    anchors, keep, prefix = built.blocks
    documents_of, length = batch["document_ids"], batch["input_ids"].shape[1]
    owner = documents_of.gather(1, anchors)
    assert bool((owner[keep] >= 0).all())
    assert bool(batch["loss_mask"].bool().gather(1, anchors)[keep].all())
    assert bool((batch["position_ids"].gather(1, anchors)[keep] >= 1).all())
    offsets = torch.arange(block_size)
    where = anchors[:, :, None] + offsets
    inside = where < length
    at = documents_of.gather(1, where.clamp(max=length - 1).flatten(1)).view_as(where)
    same = inside & (at == owner[:, :, None])
    real = built.block_ids.view_as(where) != MASK
    assert bool((same | ~real).all())  # real inputs come from the anchor's document
    targets = built.scored.view(len(anchors), -1, block_size - 1)
    assert bool((same[:, :, 1:] | ~targets).all())  # so do scored targets
    positions = built.positions[:, length:].view_as(where)
    assert torch.equal(positions, batch["position_ids"].gather(1, anchors)[:, :, None] + offsets)
    mask = create_dflash_attention_mask(anchors, keep, length, block_size, document_ids=built.document_ids)
    mask = mask[:, 0, :, :length].view(len(anchors), -1, block_size, length)
    columns = torch.arange(length)
    allowed = (documents_of[:, None, :] == owner[:, :, None]) & (columns < anchors[:, :, None]) & keep[:, :, None]
    assert torch.equal(mask, allowed[:, :, None, :].expand_as(mask))
    for d, doc in enumerate(flat):
        alone = prepare(module, plain([doc]))
        assert torch.equal(blocks_of(batch, built, d)[1], alone.blocks.anchors[alone.blocks.keep])
        assert torch.equal(prefix[blocks_of(batch, built, d)[0]], alone.blocks.prefix[alone.blocks.keep])


# --------------------------------------------------------------------------------------------------- throughput
def test_training_flops_of_packed_rows_count_their_documents():
    """Packed rows' FLOPs are the sum over their documents, each as a row of its own span."""
    module = dflash()
    plain, packed = collators(BLOCK)
    rows = documents()
    batch = packed(rows)
    alone = sum(module.training_flops(plain([doc])) for row in rows for doc in row)
    assert float(module.training_flops(batch)) == pytest.approx(alone, rel=1e-12)
    assert module.training_flops(plain([doc for row in rows for doc in row])) == 8 * module._row_flops(16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's compiled backward is checked on a GPU")
def test_packed_rows_through_flex_attention_give_the_dense_masks_loss_and_gradients_on_gpu():
    """fp32 on a GPU, packed rows: the loss and every draft gradient through flex attention's BlockMask (the document
    rule in its mask_mod, its compiled backward) equal those through sdpa's dense mask (relative norm difference <
    1e-4). Heads of 16 dims: the smallest tile of flex's Triton kernels."""
    draft = {**TINY_DFLASH_DRAFT, "head_dim": 16}
    dense = dflash(draft_config=draft, attn_implementation="sdpa").cuda()
    flex = dflash(draft_config=draft, attn_implementation="flex_attention").cuda()
    flex.model.draft.load_state_dict(dense.model.draft.state_dict())
    batch = {k: v.cuda() for k, v in collators(BLOCK)[1](documents()).items()}
    losses, grads = [], []
    for module in (dense, flex):
        loss, module_grads, *_ = loss_and_grads(module, batch)
        losses.append(loss)
        grads.append(module_grads)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    differences = {n: float((grads[1][n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in grads[0].items()}
    worst = max(differences, key=differences.get)
    print(f"packed flex vs sdpa: loss {losses[1]:.7f} vs {losses[0]:.7f}; largest relative gradient difference "
          f"{differences[worst]:.2e} ({worst})")
    assert differences[worst] < 1e-4, differences
