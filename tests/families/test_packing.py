"""Packed rows in every family that packs: a document sees only itself (no leakage), and a packed batch's loss and
gradients are those of its documents run alone, with the same keys and noise."""

import pytest
import torch

from lit_dllm.data.batch import document_inputs
from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.packing import PackedCollator
from lit_dllm.families.causal_lm.module import CausalLMModule
from lit_dllm.families.mdlm.module import HybridMDLMModule, MDLMModule
from lit_dllm.testing import TINY_LLAMA

VOCAB, MASK, PAD, EOS = 40, 39, 0, 1
LENGTHS = [[9, 5, 3], [13, 2], [6, 6, 4]]  # three packed rows of documents
PACK = 24


def documents(lengths=LENGTHS, seed=0):
    """Rows of prompt/response documents with distinct example indices."""
    g = torch.Generator().manual_seed(seed)
    rows, index = [], 0
    for row in lengths:
        docs = []
        for length in row:
            ids = torch.randint(2, MASK, (length,), generator=g)
            loss_mask = torch.zeros(length)
            loss_mask[int(torch.randint(0, length - 1, (1,), generator=g)):] = 1.0
            docs.append({"input_ids": ids, "loss_mask": loss_mask, "example_index": 100 + index})
            index += 1
        rows.append(docs)
    return rows


FAMILIES = {
    "mdlm": (MDLMModule, {}),
    "mdlm-blockwise": (MDLMModule, {"corruption": "blockwise", "block_size": 4}),
    "hybrid": (HybridMDLMModule, {"corruption": "blockwise", "block_size": 4}),
    "ar": (CausalLMModule, {}),
}


def make_module(name, attn="eager", **config):
    cls, kwargs = FAMILIES[name]
    torch.manual_seed(0)
    extra = {} if cls is CausalLMModule else {"mask_token_id": MASK}
    module = cls(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, generation={"val_generate_batches": 0},
                 backbone={"model_config": dict(TINY_LLAMA, **config), "attn_implementation": attn}, **extra, **kwargs)
    module.configure_model()
    return module


def collators(name):
    block = FAMILIES[name][1].get("block_size")
    collator = DLLMCollator(pad_token_id=PAD, eos_token_id=EOS, block_size=block)
    return collator, PackedCollator(collator, PACK)


def forward(module, batch, causal):
    kwargs = {"causal": True} if causal and not isinstance(module, CausalLMModule) else {}
    return module.model(batch["input_ids"], **document_inputs(batch), **kwargs)


@pytest.mark.parametrize("name, causal", [("mdlm", False), ("hybrid", True), ("ar", False)])
def test_a_document_sees_only_itself(name, causal):
    """fp32 eager: a document's logits do not move (exactly) when every other document of its row changes, and equal
    its logits alone (positions restart per document)."""
    module = make_module(name)
    plain, packed = collators(name)
    rows = documents()
    batch = packed(rows)
    changed = packed([[{**doc, "input_ids": (doc["input_ids"] + 7) % 30 + 2} if i else doc
                       for i, doc in enumerate(row)] for row in rows])
    with torch.no_grad():
        before, after = forward(module, batch, causal), forward(module, changed, causal)
        first = batch["document_ids"] == batch["document_ids"][:, :1]  # each row's first document
        assert torch.equal(before[first], after[first])
        assert not torch.equal(before, after)  # the other documents did change
        for d, doc in enumerate(document for row in rows for document in row):
            alone = forward(module, plain([doc]), causal)[0, : int(batch["document_spans"][d])]
            torch.testing.assert_close(before[batch["document_ids"] == d], alone, rtol=1e-5, atol=1e-5)


def loss_and_grads(module, batch, denominators=None):
    module.zero_grad()
    prepared = module.prepare_batch(batch, module.noise_keys(batch, epoch=3))
    counts = {name: value.float() for name, value in module.token_counts(batch, prepared).items()}
    step = module.compute_loss(batch, prepared, denominators or counts)
    step.output.total_loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return float(step.output.total_loss.detach()), grads, counts, prepared


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_loss_and_gradients_equal_the_documents_alone(name):
    module = make_module(name)
    plain, packed = collators(name)
    rows = documents()
    batch = packed(rows)
    loss, grads, counts, prepared = loss_and_grads(module, batch)
    if name != "ar":  # the same noise: each document's corrupted positions are those it gets alone
        assert int(prepared["noise_mask"].sum()) > 0
    alone_loss, alone_grads, alone_counts = 0.0, {}, {}
    for doc in (document for row in rows for document in row):
        one, one_grads, one_counts, _ = loss_and_grads(module, plain([doc]), denominators=counts)
        alone_loss += one
        alone_grads = {n: alone_grads.get(n, 0) + g for n, g in one_grads.items()}
        alone_counts = {n: alone_counts.get(n, 0) + c for n, c in one_counts.items()}
    assert alone_counts == counts
    assert loss == pytest.approx(alone_loss, abs=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(g, alone_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packed_noise_is_each_documents_noise_alone():
    module = make_module("mdlm-blockwise")
    plain, packed = collators("mdlm-blockwise")
    rows = documents()
    batch = packed(rows)
    noisy = module.prepare_batch(batch, module.noise_keys(batch, epoch=1))["noisy_ids"]
    for d, doc in enumerate(document for row in rows for document in row):
        alone = plain([doc])
        expected = module.prepare_batch(alone, module.noise_keys(alone, epoch=1))["noisy_ids"][0]
        assert torch.equal(noisy[batch["document_ids"] == d], expected[: int(batch["document_spans"][d])])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mdlm", "hybrid", "ar"])
def test_flex_block_masks_train_packed_rows_as_the_dense_mask_does(name):
    """On a GPU, FlexAttention's document block mask (other documents' tiles skipped) gives the loss and gradients of
    the dense additive mask under SDPA, in fp32."""
    wide = {"hidden_size": 64, "intermediate_size": 128}  # heads of 16 dims: FlexAttention's smallest on CUDA
    dense, flex = (make_module(name, attn, **wide).cuda() for attn in ("sdpa", "flex_attention"))
    flex.load_state_dict(dense.state_dict())
    _, packed = collators(name)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in packed(documents()).items()}
    dense_loss, dense_grads, _, _ = loss_and_grads(dense, batch)
    flex_loss, flex_grads, _, _ = loss_and_grads(flex, batch)
    assert flex_loss == pytest.approx(dense_loss, rel=1e-5)
    for n, g in dense_grads.items():
        torch.testing.assert_close(flex_grads[n], g, rtol=1e-4, atol=1e-5, msg=n)
