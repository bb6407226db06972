"""The RL modules: d1's estimator and objective against a straight implementation, keyed masks and rollouts (per
completion: alone, in any batch, and FSDP2 over two gloo processes as one process), the reference policy, resume,
and bad settings and input."""

import os
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from lit_dllm import ExpertParallelStrategy, Parallelism, SingleDeviceStrategy
from lit_dllm.callbacks import RunSummary
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.noise.keys import Stream, example_keys, keyed_rand
from lit_dllm import CausalGRPOModule, DiffuGRPOModule
from lit_dllm.rl.objectives import clipped_objective
from lit_dllm.testing import TINY_LLAMA

from tests.test_parallel import OPTIMIZATION, _spawn, one_thread

G = 4


def data(tmp_path, batch_size=2, task="add", **difficulty) -> DLLMDataModule:
    dm = DLLMDataModule(source={"path": f"task:{task}", "cache_dir": str(tmp_path / "cache")},
                        task={"num_train": 16, "num_val": 4, "kwargs": difficulty or {"max_digits": 2}},
                        loader={"batch_size": batch_size, "val_batch_size": 4}, collation={"prompts": True},
                        max_seq_len=24)
    dm.setup("fit")
    return dm


TINY = {**TINY_LLAMA, "max_position_embeddings": 32}


def policy(dm, cls=DiffuGRPOModule, lora=None, optimization=None, backbone=None, generation=None,
           **rl) -> DiffuGRPOModule:
    tok = dm.tokenizer
    if issubclass(cls, DiffuGRPOModule) and "estimator" not in rl:  # block-wise rollouts (gen_length 4, one block): d1's
        rl["estimator"] = "one_pass"
    torch.manual_seed(0)
    module = cls(vocab_size=len(tok), mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
                 eos_token_id=tok.eos_token_id, backbone=backbone or {"model_config": TINY},
                 generation=generation or {"gen_length": 4}, rl={"rewards": ["exact_answer"], "group_size": G, **rl},
                 lora=lora, optimization=optimization)
    module.tokenizer = tok
    module.configure_model()
    return module


def rollouts_of(module, dm):
    return module.rollout(next(iter(dm.train_dataloader())))


@pytest.mark.parametrize("cls", [DiffuGRPOModule, CausalGRPOModule])
def test_the_first_update_sees_exactly_the_old_policy(tmp_path, cls):
    """Same weights, same keyed masks: the update's log-probabilities equal the old pass's bit for bit, whether the
    rows are scored together or in micro-batches, so the ratio is exactly 1."""
    dm = data(tmp_path)
    module = policy(dm, cls, inner_updates=2)
    rollouts = rollouts_of(module, dm)
    N = len(rollouts.rewards)
    old = module.policy_logps(rollouts, slice(0, N), 0)
    new, _ = module.token_logps(rollouts, slice(0, N), 0)
    assert torch.equal(old, new)
    parts = torch.cat([module.token_logps(rollouts, slice(s, s + 3), 0)[0] for s in range(0, N, 3)])
    assert torch.allclose(parts, new, atol=1e-6)
    ratio = torch.exp(new - old)
    assert torch.equal(ratio, torch.ones_like(ratio))


def test_inner_updates_see_different_prompt_masks(tmp_path):
    dm = data(tmp_path)
    module = policy(dm, inner_updates=2, p_mask_prompt=0.5)
    rollouts = rollouts_of(module, dm)
    N = len(rollouts.rewards)
    assert not torch.equal(module.token_logps(rollouts, slice(0, N), 0)[0],
                           module.token_logps(rollouts, slice(0, N), 1)[0])


def straight_d1_loss(module, rollouts, old_logp, clip_eps):
    """d1 (diffu-GRPO, Zhao et al. 2025, eq. 3-4), row by row: the completion fully masked, the prompt masked at
    p_mask_prompt, per-token ratio of the one-pass estimates, GRPO's clipped surrogate averaged over the completion's
    tokens up to its eos, then over completions; no KL."""
    total = 0.0
    N = len(rollouts.rewards)
    for i in range(N):
        x = rollouts.ids[i].clone()
        P = int(rollouts.prompt_lengths[i])
        key = example_keys(module.noise_seed, rollouts.keys[i : i + 1] * module.rl.inner_updates, 0)
        draw = keyed_rand(key, Stream.RL_PROMPT_MASK, (1, len(x)))[0]
        for j in range(P):
            if draw[j] < module.rl.p_mask_prompt:
                x[j] = module.mask_token_id
        C = rollouts.targets.shape[1]
        x[P : P + C] = module.mask_token_id
        logits = module.model(x[None])[0]
        terms = []
        for k in range(C):
            if not rollouts.scored[i, k]:
                continue
            logp = torch.log_softmax(logits[P + k].double(), -1)[rollouts.targets[i, k]]
            ratio = torch.exp(logp - old_logp[i, k].double())
            advantage = rollouts.advantages[i].double()
            terms.append(torch.minimum(ratio * advantage, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage))
        total = total + torch.stack(terms).mean()
    return -total / N


def test_the_clipped_loss_equals_a_straight_implementation_of_d1(tmp_path):
    dm = data(tmp_path)
    module = policy(dm, p_mask_prompt=0.3)
    rollouts = rollouts_of(module, dm)
    rollouts.advantages = torch.linspace(-1.5, 1.5, len(rollouts.rewards))  # rewards of an untrained model are all 0
    N = len(rollouts.rewards)
    old = module.policy_logps(rollouts, slice(0, N), 0)
    with torch.no_grad():  # a policy that has moved: ratios away from 1, some clipped
        for param in module.model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    logp, _ = module.token_logps(rollouts, slice(0, N), 0)
    losses, stats = clipped_objective(logp, old, rollouts.advantages, rollouts.scored, 0.2)
    loss = losses.mean()
    assert 0 < stats["clip_fraction"] < 1
    assert abs(loss.item() - straight_d1_loss(module, rollouts, old, 0.2).item()) < 1e-6


def rows_of(batch: dict, rows: list[int]) -> dict:
    """The prompt batch of ``batch``'s examples ``rows``, in that order."""
    pick = lambda values: [values[row] for row in rows]  # noqa: E731
    return {"example_index": batch["example_index"][rows], "prompt_ids": pick(batch["prompt_ids"]),
            "prompt_lengths": batch["prompt_lengths"][rows], "prompt_text": pick(batch["prompt_text"]),
            "columns": {name: pick(values) for name, values in batch["columns"].items()}}


@pytest.mark.parametrize("cls", [DiffuGRPOModule, CausalGRPOModule])
def test_rollouts_are_keyed_by_the_step_and_each_completion(tmp_path, cls, monkeypatch):
    """Completion ``g`` of example ``i`` samples with noise keyed by (``i * G + g``, the step): the same completions
    again, from the example alone or in another order, and others at another step. (Prompts of one length: a dLLM's
    canvas attends to the right padding that the batch's longest prompt sets.)"""
    dm = data(tmp_path, batch_size=3, task="reverse", min_len=3, max_len=3)
    module = policy(dm, cls)
    batch = next(iter(dm.train_dataloader()))
    first = module.rollout(batch)
    assert torch.equal(first.keys, batch["example_index"].repeat_interleave(G) * G + torch.arange(G).repeat(3))
    assert len(set(first.texts)) > G  # sampled at rollout_temperature: the completions differ
    again = module.rollout(rows_of(batch, [2, 0, 1]))
    assert again.texts == first.texts[2 * G :] + first.texts[: 2 * G]
    assert all(module.rollout(rows_of(batch, [i])).texts == first.texts[i * G : (i + 1) * G] for i in range(3))
    monkeypatch.setattr(cls, "global_step", property(lambda self: 7))
    assert module.rollout(batch).texts != first.texts


def test_with_lora_the_reference_is_the_base_with_adapters_off(tmp_path):
    pytest.importorskip("peft")
    dm = data(tmp_path)
    module = policy(dm, kl_beta=0.1)
    rollouts = rollouts_of(module, dm)
    N = len(rollouts.rewards)
    base = module.policy_logps(rollouts, slice(0, N), 0)
    lora = policy(dm, lora={"r": 4}, kl_beta=0.1)
    with torch.no_grad():
        for name, param in lora.model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)  # the adapters now change the model
    assert not torch.allclose(lora.policy_logps(rollouts, slice(0, N), 0), base)
    assert torch.allclose(lora.reference_logps(rollouts, slice(0, N), 0), base, atol=1e-6)


class Recorder(L.Callback):
    def __init__(self):
        self.texts = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.texts[trainer.global_step] = module.rollout(batch).texts


def fit(tmp_path, dm, max_steps, ckpt_path=None, callbacks=()):
    module = policy(dm, inner_updates=1)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, limit_val_batches=0, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True),
                                   RunSummary(), *callbacks])  # the summary counts prompt batches' tokens
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return module


def test_a_resumed_run_samples_the_rollouts_of_an_uninterrupted_one(tmp_path):
    whole = Recorder()
    fit(tmp_path / "whole", data(tmp_path), 4, callbacks=[whole])
    fit(tmp_path / "cut", data(tmp_path), 2)
    resumed = Recorder()
    fit(tmp_path / "cut", data(tmp_path), 4, ckpt_path=str(tmp_path / "cut" / "ckpt" / "last.ckpt"),
        callbacks=[resumed])
    assert sorted(resumed.texts) == [2, 3]
    assert all(resumed.texts[step] == whole.texts[step] for step in (2, 3))


def test_bad_settings_name_the_fix(tmp_path):
    dm = data(tmp_path)
    with pytest.raises(ValueError, match="rl.rewards is empty"):
        policy(dm, rewards=[])
    with pytest.raises(ValueError, match="objective='ppo'"):
        policy(dm, objective="ppo")
    with pytest.raises(ValueError, match="group_size=1"):
        policy(dm, group_size=1)
    module = policy(dm, kl_beta=0.1)
    with pytest.raises(ValueError, match="backbone.model"):
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                  default_root_dir=tmp_path, enable_checkpointing=False).fit(module, dm)
    supervised = DLLMDataModule(source={"path": "task:add", "cache_dir": str(tmp_path / "cache")},
                                task={"num_train": 16, "num_val": 4}, max_seq_len=24)
    with pytest.raises(ValueError, match="prompts"):
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                  default_root_dir=tmp_path, enable_checkpointing=False).fit(policy(dm), supervised)


def quiet_fit(module, dm, tmp_path, max_steps=1, **trainer):
    L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=0,
              enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
              **trainer).fit(module, dm)


def never_sampled(*args):
    raise AssertionError("sampled")


@pytest.mark.parametrize("cls", [DiffuGRPOModule, CausalGRPOModule])
def test_a_prompt_and_rollout_past_the_models_positions_are_refused_before_sampling(tmp_path, cls):
    dm = data(tmp_path)
    module = policy(dm, cls, rollout_length=28)  # the prompts take 4 to 6 tokens; 32 positions
    module.sample = never_sampled
    with pytest.raises(ValueError, match=r"prompt \(\d tokens\) \+ rl\.rollout_length 28 = 3\d positions > "
                                         r"max_position_embeddings=32 .* lower rl\.rollout_length"):
        module.rollout(next(iter(dm.train_dataloader())))


@pytest.mark.parametrize("cls", [DiffuGRPOModule, CausalGRPOModule])
def test_the_kl_reference_has_the_policys_vocabulary(tmp_path, cls):
    """The frozen reference is built as the policy is (``build_model`` from ``backbone.model``): an export with fewer
    embedding rows than the tokenizer has tokens grows to the same rows in both."""
    dm = data(tmp_path)
    small = AutoConfig.for_model(**{**TINY, "vocab_size": len(dm.tokenizer) - 4})
    AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path / "sft")
    module = policy(dm, cls, backbone={"model": str(tmp_path / "sft")}, kl_beta=0.1)
    quiet_fit(module, dm, tmp_path)
    rows = [model.hf.get_input_embeddings().weight.shape[0] for model in (module._reference[0], module.model)]
    assert rows[0] == rows[1] >= len(dm.tokenizer)


def test_lora_with_fp8_is_refused_before_the_first_rollout(tmp_path, monkeypatch):
    """LoRA and fp8 do not combine (fp8 converts only the small trainable adapters): under RL too, an error before any
    rollout."""
    monkeypatch.setattr("lit_dllm.fp8.check_fp8_device", lambda device: None)  # as on a GPU with float8 cores
    pytest.importorskip("peft")
    dm = data(tmp_path)
    module = policy(dm, lora={"r": 4})
    module.sample = never_sampled
    with pytest.raises(ValueError, match="parallelism.fp8='rowwise' with lora is not supported"):
        quiet_fit(module, dm, tmp_path, strategy=SingleDeviceStrategy(parallelism=Parallelism(fp8="rowwise")))


# ---------------------------------------------------------------------- FSDP2 over two gloo processes vs one process
def length_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """A reward that the sampled completions spread over: their length (in characters, before eos)."""
    return [float(len(text)) for text in completions]


class RecordingGRPO(DiffuGRPOModule):
    """Keeps each step's rollouts and the passes of the model that sampled them: ``recorded[global step] = (passes,
    {key: (text, reward)})``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded = {}

    def rollout(self, batch):
        passes = []
        hook = self.model.hf.register_forward_hook(lambda *_: passes.append(1))
        try:
            rollouts = super().rollout(batch)
        finally:
            hook.remove()
        rows = dict(zip(rollouts.keys.tolist(), zip(rollouts.texts, rollouts.rewards.tolist())))
        self.recorded[self.global_step] = (len(passes), rows)
        return rollouts


FSDP2_RUNS = {"full": {}, "lora+kl": {"lora": {"r": 4}, "kl_beta": 0.1}}
"""The fits compared: full fine-tuning, and LoRA with the KL reference (the base: its adapters switched off)."""
SHARPEN = 30.0
"""LM-head scale of the random policy: its tokens often pass the fast sampler's threshold (0.2), so a block may end
early and the ranks' rows need different numbers of passes."""


def sharpened_policy(tmp_path, world: int, **settings) -> tuple[RecordingGRPO, DLLMDataModule]:
    """The policy of the FSDP2 fits (the fast sampler, SGD with momentum at a constant LR of 0.1, ``settings``) and
    its data: prompts of one length, 4 / ``world`` a process."""
    dm = data(tmp_path, batch_size=4 // world, task="reverse", min_len=3, max_len=3)
    module = policy(dm, RecordingGRPO, optimization=OPTIMIZATION,
                    generation={"sampler": "fast", "gen_threshold": 0.2, "gen_length": 8, "gen_block_length": 4},
                    inner_updates=2, rewards=["tests.rl.test_grpo.length_reward"], **settings)
    with torch.no_grad():
        module.model.hf.lm_head.weight.mul_(SHARPEN)
    return module, dm


def recorded_fit(tmp_path, world: int, **settings) -> tuple[dict, dict]:
    """3 batches of 4 prompts (``world`` processes; FSDP2 over more than one), 2 inner updates each, of
    :func:`sharpened_policy`: each step's sampling passes on every rank and rollouts (merged), and the final weights,
    gathered."""
    module, dm = sharpened_policy(tmp_path, world, **settings)
    # a rank out of step waits in a collective: a 60 s timeout fails the test instead of hanging it
    strategy = ExpertParallelStrategy(timeout=timedelta(seconds=60)) if world > 1 else "auto"
    trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=world, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, dm)
    ranks = [module.recorded]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, module.recorded)
    recorded = {step: ([rank[step][0] for rank in ranks],
                       {key: row for rank in ranks for key, row in rank[step][1].items()})
                for step in ranks[0]}
    weights = {name: value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
               for name, value in module.model.state_dict().items()}
    return recorded, weights


def mean_rewards(recorded: dict) -> list[float]:
    """Each step's mean reward over all its completions."""
    return [sum(reward for _, reward in rows.values()) / len(rows) for _, rows in recorded.values()]


def _fsdp2_fit_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of each :data:`FSDP2_RUNS` fit under Lightning (the environment of an outside launcher, as torchrun's);
    rank 0 saves the results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    with one_thread():
        results = {run: recorded_fit(Path(out) / run / f"rank{rank}", world, **settings)
                   for run, settings in FSDP2_RUNS.items()}
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def fsdp2_fits(tmp_path_factory):
    return _spawn(_fsdp2_fit_worker, 2, tmp_path_factory.mktemp("gloo"))


@pytest.mark.parametrize("run", FSDP2_RUNS)
def test_fsdp2_over_two_processes_samples_and_trains_as_one_process(fsdp2_fits, tmp_path, run):
    """diffu-GRPO with ``lit_dllm.ExpertParallelStrategy`` (FSDP2) over two gloo processes of 2 prompts each against one
    process of the same 4: every step's rollouts (each completion's text and reward) are the same, so are the mean
    rewards, each rank sampled with as many passes as the one process (the ranks stay in step, though one rank's
    rows alone need fewer), and the final weights agree to float32 rounding."""
    with one_thread():
        expected_rollouts, expected_weights = recorded_fit(tmp_path / "one", 1, **FSDP2_RUNS[run])
        module, dm = sharpened_policy(tmp_path / "alone", 1, **FSDP2_RUNS[run])
        batch = next(iter(dm.train_dataloader()))
        alone = []
        for rows in ([0, 2], [1, 3]):  # each rank's examples of the first batch (every second one)
            module.rollout(rows_of(batch, rows))
            alone.append(module.recorded[0][0])
    assert alone[0] != alone[1]  # so one rank ran passes only the other's rows needed
    rollouts, weights = fsdp2_fits[run]
    assert list(rollouts) == [0, 2, 4]  # the global steps of the batches of rollouts (2 inner updates each)
    for step, (passes, rows) in rollouts.items():
        expected_passes, expected_rows = expected_rollouts[step]
        assert rows == expected_rows, step
        assert passes == expected_passes * 2, step  # both ranks: every pass the slowest row of the 4 prompts needed
    assert mean_rewards(rollouts) == mean_rewards(expected_rollouts) and len(set(mean_rewards(rollouts))) > 1
    for name, value in expected_weights.items():  # weights up to 0.17; measured |difference| <= 7e-8 full, 4e-7 LoRA
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
