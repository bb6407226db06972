import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lit_dllm.data.tokenizer import CHARACTERS, build_default_tokenizer, load_tokenizer

TASK_TEXT = "rev 4821=1284 sort 4821=1248 482+97=579"


@pytest.fixture
def tokenizer_dir_without(tmp_path):
    """Save a tiny word-level tokenizer lacking some special tokens; returns a factory of its directory."""

    def save(**special_tokens) -> str:
        vocab = {token: i for i, token in enumerate(["<unk>", "<eos>", "<pad>", "a", "b"])}
        backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special_tokens).save_pretrained(tmp_path)
        return str(tmp_path)

    return save


def test_round_trip_through_auto_tokenizer(tmp_path):
    built = build_default_tokenizer(save_dir=tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in (CHARACTERS, TASK_TEXT):
        ids = built(text)["input_ids"]
        assert len(ids) == len(text)  # one id per character
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids) == text
    assert loaded.get_vocab() == built.get_vocab()
    assert loaded.chat_template == built.chat_template
    for name in ("pad_token_id", "eos_token_id", "mask_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(built, name)


def test_special_token_ids():
    tokenizer = load_tokenizer(None)
    ids = [tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id, tokenizer.unk_token_id]
    assert ids == [0, 1, 2, 3]
    assert len(tokenizer) == 7 + len(CHARACTERS)
    assert tokenizer.decode(tokenizer("<mask>12<eos>")["input_ids"], skip_special_tokens=True) == "12"


def test_chat_template():
    tokenizer = build_default_tokenizer()
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2="},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>Be exact.<|user|>1+2=<|assistant|>3<eos><|user|>2+2=<|assistant|>"
    assert tokenizer.apply_chat_template(messages[1:3], tokenize=False) == "<|user|>1+2=<|assistant|>3<eos>"
    role_ids = tokenizer("<|system|><|user|><|assistant|>")["input_ids"]
    assert role_ids == [4, 5, 6]


def test_chat_template_rejects_unknown_role():
    with pytest.raises(Exception, match="unknown chat role tool"):
        build_default_tokenizer().apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_missing_mask_token_is_an_error_unless_configured(tokenizer_dir_without):
    path = tokenizer_dir_without(eos_token="<eos>", pad_token="<pad>")
    with pytest.raises(ValueError, match="has no mask token. Pass mask_token="):
        load_tokenizer(path)
    tokenizer = load_tokenizer(path, mask_token="<mask>")
    assert tokenizer.mask_token_id == len(tokenizer) - 1 == 5


def test_missing_pad_falls_back_to_eos(tokenizer_dir_without):
    tokenizer = load_tokenizer(tokenizer_dir_without(eos_token="<eos>"), mask_token="<mask>")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 1


def test_missing_pad_with_eos_as_mask_is_an_error(tokenizer_dir_without):
    """Adding a pad would leave mask = eos: the message must not suggest it."""
    with pytest.raises(ValueError, match=r"mask token '<eos>' \(id 1\) is also its eos token") as error:
        load_tokenizer(tokenizer_dir_without(eos_token="<eos>"), mask_token="<eos>")
    assert "pad_token" not in str(error.value)


@pytest.mark.parametrize(("mask_token", "roles"), [("<eos>", "eos"), ("", "unk"), ("<unk>", "unk"), ("<pad>", "pad")])
def test_mask_token_aliasing_a_special_role_is_an_error(mask_token, roles):
    """Every occurrence of that token (each answer's eos, each unknown character) would read as masked."""
    with pytest.raises(ValueError, match=rf"mask token {mask_token!r} \(id \d\) is also its {roles} token.*"
                                         r"'<\|mask\|>'"):
        load_tokenizer(None, mask_token=mask_token, require_mask=False)


def test_mask_token_aliasing_bos_is_an_error(tokenizer_dir_without):
    path = tokenizer_dir_without(eos_token="<eos>", pad_token="<pad>", bos_token="<s>")
    with pytest.raises(ValueError, match=r"mask token '<s>' \(id 5\) is also its bos token"):
        load_tokenizer(path, mask_token="<s>")


def test_missing_eos_is_an_error(tokenizer_dir_without):
    with pytest.raises(ValueError, match="has no eos token"):
        load_tokenizer(tokenizer_dir_without(pad_token="<pad>"), mask_token="<mask>")


def test_unreachable_hub_id_names_it_and_suggests_a_local_path():
    with pytest.raises(ValueError, match="(?s)'nobody/no-such-tokenizer'.*Pass a local directory"):
        load_tokenizer("nobody/no-such-tokenizer")


def test_mask_token_that_is_an_ordinary_token_is_rejected(tmp_path):
    """Adding "1" as the mask would turn every "1" of the data into the mask."""
    from tests.data.test_datamodule import gpt2_tokenizer

    with pytest.raises(ValueError, match=r"mask_token='1' is an ordinary token of tokenizer .* \(id 8\).*'<\|mask\|>'"):
        load_tokenizer(None, mask_token="1")
    gpt2_tokenizer(with_extras=False).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"mask_token='1' is an ordinary token of tokenizer .* \(id 16\)"):
        load_tokenizer(str(tmp_path), mask_token="1")


def test_mask_token_that_already_is_special_is_used_as_is(tokenizer_dir_without):
    """Like LLaDA's <|mdm_mask|>: a special token of the tokenizer becomes the mask without adding an id."""
    path = tokenizer_dir_without(eos_token="<eos>", pad_token="<pad>", additional_special_tokens=["<|mdm_mask|>"])
    tokenizer = load_tokenizer(path, mask_token="<|mdm_mask|>")
    assert (tokenizer.mask_token_id, len(tokenizer)) == (5, 6)
    assert load_tokenizer(None, mask_token="<mask>").mask_token_id == 2
