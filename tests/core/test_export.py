"""Issue 49: ``save_pretrained`` writes a folder or says why not, replaces an earlier export's weights (a stale shard
index included) without touching the user's files, and never writes a tokenizer that does not fit the model. Issue 60:
a folder of files no export wrote (another model, a config of yours) is refused unless ``overwrite=True``."""

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModel, AutoModelForCausalLM, MuseGlimmerAssistantModel

from lit_dllm import CausalLMModule, MDLMModule, build_default_tokenizer
from lit_dllm.hub.marker import EXPORT_MARKER, mark_export
from lit_dllm.testing import TINY_LLAMA
from tests.test_parallel import _spawn

TOK = build_default_tokenizer()


def causal(seed: int = 0, **kwargs) -> CausalLMModule:
    torch.manual_seed(seed)
    args = dict(vocab_size=len(TOK), pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id,
                backbone={"model_config": TINY_LLAMA})
    module = CausalLMModule(**{**args, **kwargs})
    module.configure_model()
    return module


def test_a_file_is_not_an_export_folder(tmp_path):
    """transformers' save_pretrained only logs and returns when its folder is a file: the export names it."""
    from tests.families.dflash.test_dflash import dflash

    target = tmp_path / "model.bin"
    target.write_text("not a folder")
    calls = [causal().save_pretrained, dflash().save_pretrained, dflash().export_zlab]
    for save in calls:
        with pytest.raises(ValueError, match=rf"{target}' is a file, not a folder: pass the path of a folder"):
            save(target)
    assert target.read_text() == "not a folder"


def test_an_earlier_sharded_export_is_replaced_and_the_users_files_stay(tmp_path):
    old = causal(seed=1).model.hf
    old.save_pretrained(tmp_path, max_shard_size="20KB")  # an earlier export, in shards
    mark_export(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) > 1
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "runs.index.json").write_text('{"runs": []}')  # not a weights index
    module = causal(seed=2)
    module.save_pretrained(tmp_path)
    assert not index.exists() and not any((tmp_path / shard).exists() for shard in shards)
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "runs.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, param in module.model.hf.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], param), name


def test_an_earlier_single_file_export_and_adapter_are_removed(tmp_path):
    """A sharded export after a single-file one (or a merged one after PEFT's adapter) would load the old weights."""
    from lit_dllm.core.export import export_folder

    mark_export(tmp_path)
    for name in ("model.safetensors", "adapter_model.safetensors", "adapter_config.json", "notes.txt"):
        (tmp_path / name).write_text("old")
    (tmp_path / "weights.index.json").write_text(json.dumps({"weight_map": {"a": "../outside.bin", "b": "w-1.bin"}}))
    (tmp_path / "w-1.bin").write_text("old")
    (tmp_path.parent / "outside.bin").write_text("kept")
    assert export_folder(tmp_path) == tmp_path
    assert sorted(path.name for path in tmp_path.iterdir()) == [EXPORT_MARKER, "notes.txt"]
    assert (tmp_path.parent / "outside.bin").exists()  # an index never reaches out of its folder


def test_a_tokenizer_that_does_not_fit_the_model_is_not_exported(tmp_path):
    """A module built in Python without a tokenizer has the embedded 96-token default: beside a 50-row model with
    another mask id it would mislead; the model is written alone, with a warning naming both and the fix."""
    module = MDLMModule(vocab_size=50, mask_token_id=49, backbone={"model_config": TINY_LLAMA})
    with pytest.warns(UserWarning, match=r"without a tokenizer.*\(96 tokens, mask id 2\).*vocab_size=50 and "
                                         r"mask_token_id=49.*Set module.tokenizer"):
        module.save_pretrained(tmp_path)
    assert not (tmp_path / "tokenizer_config.json").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path).get_input_embeddings().weight.shape[0] == 50
    mask = MDLMModule(vocab_size=len(TOK), mask_token_id=5, backbone={"model_config": TINY_LLAMA})
    with pytest.warns(UserWarning, match=r"mask id 2\).*mask_token_id=5"):
        mask.save_pretrained(tmp_path / "mask")
    fits = causal()
    fits.save_pretrained(tmp_path / "fits")  # the default tokenizer of a 96-token model is its own
    assert (tmp_path / "fits" / "tokenizer_config.json").exists()


def test_a_folder_of_files_no_export_wrote_is_refused_unless_overwrite(tmp_path):
    """Another model's folder, or a folder holding a config of yours: refused before any build, naming the files and
    the fix, and left as it was; ``overwrite=True`` writes there, and the folder is an export's from then on."""
    other = tmp_path / "other"
    causal(seed=1).model.hf.save_pretrained(other)  # another model, written by transformers
    TOK.save_pretrained(other)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "settings"}')
    for folder in (other, mine):
        before = {path.name: path.read_bytes() for path in folder.iterdir()}
        with pytest.raises(ValueError, match=rf"{folder}' holds files that no lit_dllm export wrote \(.*config.json.*"
                                             rf"no {EXPORT_MARKER}\).*new or empty folder, or pass overwrite=True"):
            causal(seed=2).save_pretrained(folder)
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    module = causal(seed=2)
    module.save_pretrained(mine, overwrite=True)
    module.save_pretrained(mine)  # now an earlier export: replaced
    assert json.loads((mine / EXPORT_MARKER).read_text()) == {"module": "lit_dllm.families.causal_lm.module.CausalLMModule"}
    assert AutoModelForCausalLM.from_pretrained(mine).config.vocab_size == len(TOK)


def test_a_gguf_export_of_before_the_shared_marker_is_an_earlier_export(tmp_path):
    from lit_dllm.hub.marker import check_export_folder

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "lit_dllm_gguf_export.json").write_text("{}")  # the GGUF export's marker until issue 60
    assert check_export_folder(tmp_path) == tmp_path


def _export_worker(rank: int, world: int, port: int, out: str, family: str) -> None:
    """Every rank exports its copy of one model to one folder (``family``: a CausalLM, or a DFlash draft by both of
    its exports); rank 0 writes its first file a second before the marker, while rank 1 is still checking the
    folder. Each rank that writes weights leaves ``wrote_<rank>``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        if family == "dflash":
            from tests.families.dflash.test_dflash import dflash

            module = dflash()
            writer, exports = module.model.draft, [module.save_pretrained, module.export_zlab]
        else:
            module = causal()
            writer, exports = module.model.hf, [module.save_pretrained]
        save = writer.save_pretrained
        writer.save_pretrained = lambda *args, **kwargs: (Path(out, f"wrote_{rank}").touch(), save(*args, **kwargs))
        if rank == 0:
            import lit_dllm.core.export as export

            mark = export.mark_export

            def slow_mark(folder, **record):
                (Path(folder) / "config.json").write_text("{}")
                time.sleep(1.0)
                mark(folder, **record)

            export.mark_export = slow_mark
        else:
            time.sleep(0.3)
        for number, export_to in enumerate(exports):
            export_to(Path(out) / f"model{number}")
        if rank == 0:
            torch.save({}, Path(out) / "results.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["causal", "dflash"])
def test_in_a_process_group_every_rank_checks_the_folder_and_rank_0_alone_writes(tmp_path, family):
    """Under data parallelism every rank calls the export. A rank still checking the folder once rank 0 had begun
    writing it saw files without a marker and refused them (a CI failure), and each rank wrote a DFlash draft's files
    at once. Now each rank checks, then rank 0 alone writes and the others wait for it."""
    _spawn(_export_worker, 2, tmp_path, family)
    assert sorted(path.name for path in tmp_path.glob("wrote_*")) == ["wrote_0"]
    assert (tmp_path / "model0" / EXPORT_MARKER).is_file()
    if family == "causal":
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "model0").config.vocab_size == len(TOK)
    else:
        assert isinstance(AutoModel.from_pretrained(tmp_path / "model0"), MuseGlimmerAssistantModel)
        assert json.loads((tmp_path / "model1" / "config.json").read_text())["dflash_config"]
