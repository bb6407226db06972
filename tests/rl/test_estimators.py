"""A dLLM policy's log-probability estimators (one pass, exact left to right, the ELBO) against their definitions, the
RL step's road (micro-batches, the finite check, the measurements) and the bad settings of the RL issue."""

import itertools
import math

import lightning as L
import numpy as np
import pytest
import torch

from lit_dllm import CausalGRPOModule, DiffuGRPOModule, Optimization
from tests.rl.test_grpo import G, TINY, data, policy, quiet_fit, rollouts_of

LEFT_TO_RIGHT = {"gen_length": 4, "gen_block_length": 1}
ESTIMATORS = {
    "one_pass": {},
    "exact": {"estimator": "exact"},
    "elbo": {"estimator": "elbo", "mc_samples": 2},
    "elbo_quadrature": {"estimator": "elbo", "mc_samples": 3, "t_sampling": "quadrature"},
}


def estimator_policy(dm, name, **rl):
    settings = ESTIMATORS[name]
    generation = LEFT_TO_RIGHT if settings.get("estimator") == "exact" else None
    return policy(dm, generation=generation, **settings, **rl)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_gives_ratio_exactly_one_for_an_unchanged_policy(tmp_path, name):
    """The old-policy pass and the update of one inner update draw the same masks: equal log-probabilities bit for
    bit, and another inner update draws others (the exact estimator draws none)."""
    dm = data(tmp_path)
    module = estimator_policy(dm, name, inner_updates=2)
    rollouts = rollouts_of(module, dm)
    N = len(rollouts.rewards)
    old = module.policy_logps(rollouts, slice(0, N), 0)
    new, _ = module.token_logps(rollouts, slice(0, N), 0)
    assert torch.equal(torch.exp(new - old), torch.ones_like(new))
    parts = torch.cat([module.token_logps(rollouts, slice(s, s + 3), 0)[0] for s in range(0, N, 3)])
    assert torch.allclose(parts, new, atol=1e-6)
    other = module.policy_logps(rollouts, slice(0, N), 1)
    assert torch.equal(other, old) == (name == "exact")


def test_the_exact_estimator_is_one_forward_per_position(tmp_path):
    """Token k of a completion: the prompt and the tokens before k clean, masks from k to the canvas's end, the pad
    after it as the sampler laid it out; written here one forward at a time."""
    dm = data(tmp_path)
    module = estimator_policy(dm, "exact")
    rollouts = rollouts_of(module, dm)
    logp = module.exact_logps(rollouts, slice(0, len(rollouts.rewards)))
    C = rollouts.targets.shape[1]
    with torch.no_grad():
        for i in range(len(rollouts.rewards)):
            P = int(rollouts.prompt_lengths[i])
            for k in range(C):
                if not rollouts.scored[i, k]:
                    assert logp[i, k] == 0
                    continue
                x = rollouts.ids[i].clone()
                x[P + k : P + C] = module.mask_token_id
                logits = module.model(x[None])[0, P + k].double()
                expected = torch.log_softmax(logits, -1)[rollouts.targets[i, k]]
                assert abs(logp[i, k].item() - expected.item()) < 1e-6


@pytest.mark.parametrize("sampler", ["llada", "fast"])
@pytest.mark.parametrize("canvas_multiple", [None, 16])
def test_left_to_right_rollouts_are_scored_by_the_exact_estimator_as_sampled(tmp_path, sampler, canvas_multiple):
    """At temperature 1 the exact estimator is the rollout's own likelihood: each committed token's log-probability
    equals the one the sampler drew it with (on rows as wide as the sampler's, rounded up to the canvas multiple)."""
    dm = data(tmp_path)
    module = policy(dm, generation={**LEFT_TO_RIGHT, "sampler": sampler, "gen_canvas_multiple": canvas_multiple},
                    estimator="exact")
    rollouts = rollouts_of(module, dm)
    logp = module.exact_logps(rollouts, slice(0, len(rollouts.rewards)))
    known = rollouts.scored & rollouts.rollout_logp.isfinite()
    assert known.sum() >= len(rollouts.rewards)
    assert torch.allclose(logp[known], rollouts.rollout_logp[known], atol=1e-5)


def elbo_definition(module, rollouts, row):
    """The ELBO of ``row``'s scored tokens by enumeration: every subset S of the canvas masked, the prompt clean,
    weighted by ``∫ t^(|S|-1) (1-t)^(C-|S|) dt`` over t uniform in (eps, 1 - eps)."""
    eps, C = module.eps, rollouts.targets.shape[1]
    P = int(rollouts.prompt_lengths[row])
    total = 0.0
    for size in range(1, C + 1):
        density = np.polynomial.Polynomial([0] * (size - 1) + [1]) * np.polynomial.Polynomial([1, -1]) ** (C - size)
        integral = density.integ()
        weight = (integral(1 - eps) - integral(eps)) / (1 - 2 * eps)
        for subset in itertools.combinations(range(C), size):
            x = rollouts.ids[row].clone()
            x[[P + k for k in subset]] = module.mask_token_id
            with torch.no_grad():
                logp = torch.log_softmax(module.model(x[None])[0].double(), -1)
            total += weight * sum(logp[P + k, rollouts.targets[row, k]].item() for k in subset
                                  if rollouts.scored[row, k])
    return total


def elbo_draws(module, rollouts, rows, draws=400):
    with torch.no_grad():
        return torch.stack([(module.token_logps(rollouts, rows, 0, draw=d)[0] * rollouts.scored[rows]).sum(1)
                            for d in range(draws)]).double()


def test_the_elbo_matches_its_definition_and_variance_reduction_lowers_its_spread(tmp_path):
    """Over many mask keys the coupled, stratified ELBO's mean is the enumerated ELBO (within 4 standard errors), and
    its spread is below a single uncoupled sample's on the same rows."""
    dm = data(tmp_path)
    reduced = estimator_policy(dm, "elbo")
    rollouts = rollouts_of(reduced, dm)
    rows = slice(0, 3)
    estimates = elbo_draws(reduced, rollouts, rows)
    for row in range(3):
        error = estimates[:, row].std() / math.sqrt(len(estimates))
        assert abs(estimates[:, row].mean() - elbo_definition(reduced, rollouts, row)) < 4 * error
    plain = policy(dm, estimator="elbo", mc_samples=1, coupled=False)
    assert (estimates.var(0) < elbo_draws(plain, rollouts, rows).var(0)).all()
    quadrature = estimator_policy(dm, "elbo_quadrature")
    quadrature_estimates = elbo_draws(quadrature, rollouts, rows)
    for row in range(3):
        error = quadrature_estimates[:, row].std() / math.sqrt(len(quadrature_estimates))
        assert abs(quadrature_estimates[:, row].mean() - elbo_definition(reduced, rollouts, row)) < 4 * error


@pytest.mark.parametrize("cls, generation", [(DiffuGRPOModule, {"sampler": "llada"}),
                                             (DiffuGRPOModule, {"sampler": "fast"}), (CausalGRPOModule, None)])
def test_the_rollout_temperature_is_applied_by_every_sampler(tmp_path, cls, generation):
    dm = data(tmp_path, batch_size=1)
    generation = generation and {"gen_length": 4, **generation}
    sampled = policy(dm, cls, generation=generation, group_size=16, rollout_temperature=1.0)
    assert len(set(rollouts_of(sampled, dm).texts)) > 1
    greedy = policy(dm, cls, generation=generation, group_size=16, rollout_temperature=0.0)
    assert len(set(rollouts_of(greedy, dm).texts)) == 1


def final_weights(tmp_path, dm, patch=lambda module: None, **rl):
    """The weights after one SGD step at lr 1 (they move by the gradient), ``patch(module)`` applied before it."""
    module = policy(dm, optimization=Optimization(lr=1.0, weight_decay=0.0, warmup=0, min_lr_ratio=1.0,
                                                  optimizer=lambda groups, lr=1.0: torch.optim.SGD(groups, lr=lr)),
                    max_grad_norm=None, **rl)
    patch(module)
    quiet_fit(module, dm, tmp_path)
    return torch.cat([p.detach().flatten() for p in module.model.parameters()])


@pytest.mark.parametrize("objective", ["clipped", "sequence", "weighted"])
def test_micro_batches_of_any_size_give_the_unsplit_update(tmp_path, objective):
    """One SGD step at lr 1 moves the weights by the gradient: micro-batches of 3 (which split the groups of 4) give
    the unsplit one within 1e-6 (wd1 among them: its group weights come from the whole batch)."""
    dm = data(tmp_path)
    whole = final_weights(tmp_path, dm, objective=objective, p_mask_prompt=0.5)
    split = final_weights(tmp_path, dm, objective=objective, p_mask_prompt=0.5, micro_batch_size=3)
    assert torch.allclose(whole, split, atol=1e-6)


@pytest.mark.parametrize("name", ["exact", "elbo", "one_pass"])
def test_a_budget_of_forward_rows_gives_the_unsplit_update(tmp_path, name):
    """``rl.micro_batch_rows=3``: the exact estimator's completions (one forward row per scored token, 1-5 each) and
    the ELBO's (4 rows each: 2 samples and their complements) go one by one or a few at a time; the weights after one
    SGD step equal the unsplit step's within 1e-6."""
    dm = data(tmp_path)
    settings = {**ESTIMATORS[name], "p_mask_prompt": 0.5}
    generation = LEFT_TO_RIGHT if name == "exact" else None
    whole = final_weights(tmp_path, dm, generation=generation, **settings)
    budget = final_weights(tmp_path, dm, generation=generation, micro_batch_rows=3, **settings)
    assert torch.allclose(whole, budget, atol=1e-6)


@pytest.mark.parametrize("budget, size", [(1, None), (4, None), (7, 2), (10**6, 3)])
def test_micro_batches_are_consecutive_completions_within_the_row_budget(tmp_path, budget, size):
    """Every completion once, in order; a micro-batch holds at most ``micro_batch_size`` completions and at most
    ``micro_batch_rows`` forward rows (the exact estimator's: its scored tokens) unless one completion alone has more."""
    dm = data(tmp_path)
    module = estimator_policy(dm, "exact", micro_batch_rows=budget, micro_batch_size=size)
    rollouts = rollouts_of(module, dm)
    rows = rollouts.scored.sum(1)
    chunks = module.micro_batches(rollouts)
    assert torch.equal(torch.cat([torch.arange(len(rows))[c] for c in chunks]), torch.arange(len(rows)))
    for chunk in chunks:
        assert chunk.stop - chunk.start <= (size or len(rows))
        assert rows[chunk].sum() <= budget or chunk.stop - chunk.start == 1
    if budget == 1:
        assert len(chunks) == len(rows)
    if budget == 10**6:
        assert [c.stop - c.start for c in chunks] == [3] * (len(rows) // 3) + ([len(rows) % 3] if len(rows) % 3 else [])


def alternating_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """Groups 0, 2, ... all score 1 (tied); in groups 1, 3, ... completion g scores g (they differ)."""
    return [float(row % G) if (row // G) % 2 else 1.0 for row in range(len(completions))]


@pytest.mark.parametrize("policy_settings", [{}, {"estimator": "exact", "generation": LEFT_TO_RIGHT},
                                             {"estimator": "elbo", "objective": "weighted"}, {"cls": CausalGRPOModule}],
                         ids=["one_pass", "exact", "elbo-wd1", "causal"])
def test_an_update_of_some_groups_trains_on_those_rows_alone(tmp_path, policy_settings):
    """``rl.update_groups=2`` of a batch of 4 prompts whose groups 0 and 2 tie: the step moves the weights exactly as
    a step on the rollouts of groups 1 and 3 alone (the loss their mean), and the logs count the tied groups among
    those sampled (half) and those updated (none); for each estimator, wd1 and the AR policy."""
    dm = data(tmp_path, batch_size=4)
    settings = {"rewards": ["tests.rl.test_estimators.alternating_reward"], "p_mask_prompt": 0.5, **policy_settings}
    logged = []

    def record(module):
        module.log_dict = lambda values, **kwargs: logged.append(values)

    kept = final_weights(tmp_path, dm, record, update_groups=2, **settings)
    assert logged[0]["train/tied_groups"] == 0.5 and logged[0]["train/update_tied_groups"] == 0
    rows = torch.cat([torch.arange(G, 2 * G), torch.arange(3 * G, 4 * G)])

    def sample_groups_1_and_3(module):
        rollout = module.rollout
        module.rollout = lambda batch: rollout(batch).take(rows)

    alone = final_weights(tmp_path, dm, sample_groups_1_and_3, **settings)
    whole = final_weights(tmp_path, dm, **settings)
    assert torch.allclose(kept, alone, atol=1e-6) and not torch.allclose(kept, whole, atol=1e-4)


class PoisonAt(L.Callback):
    """From optimizer step ``step`` on, the estimator returns NaN log-probabilities."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step >= self.step:
            estimate = type(module).token_logps
            module.token_logps = lambda *a, **k: (estimate(module, *a, **k)[0] * math.nan, estimate(module, *a, **k)[1])


def test_a_non_finite_rl_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    dm = data(tmp_path)
    module = policy(dm)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=0,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[checkpoints, PoisonAt(2)])
    with pytest.raises(FloatingPointError, match="Non-finite training loss .* optimizer step 3"):
        trainer.fit(module, dm)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2
    assert type(saved["hyper_parameters"]["rl"]) is dict  # no path to the group's module: it may move (0.2 did)
    for name, value in module.state_dict().items():  # the weights are those of the checkpoint: no update applied
        assert torch.isfinite(value).all() and torch.equal(value, saved["state_dict"][name]), name


def test_the_measurements_are_logged_every_step(tmp_path):
    dm = data(tmp_path)
    module = policy(dm, estimator="elbo", diagnostic_rows=4)
    logged = []
    module.log_dict = lambda values, **kwargs: logged.append(values)
    quiet_fit(module, dm, tmp_path, max_steps=2)
    assert len(logged) == 2
    for values in logged:
        assert 0 <= values["train/tied_groups"] <= 1 and 1 <= values["train/distinct_completions"] <= 4
        assert -1 <= values["train/exact_correlation"] <= 1 and values["train/key_logratio_rms"] > 0
        assert {"train/seconds_rollout", "train/seconds_update", "train/seconds_old_policy"} <= set(values)


def one_right_completion(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """Only the second completion of the first group is right."""
    return [float(row == 1) for row in range(len(completions))]


@pytest.mark.parametrize("cls", [DiffuGRPOModule, CausalGRPOModule])
def test_solved_groups_counts_the_prompts_with_a_right_completion(tmp_path, cls):
    """``train/solved_groups`` is pass@G of the sampled prompts: of 4 groups only the first holds a right completion
    (1 of its G), so 1/4 where ``train/accuracy`` (pass@1) is 1/(4 G); the ceiling the updates can sharpen toward."""
    dm = data(tmp_path, batch_size=4)
    module = policy(dm, cls=cls, rewards=["tests.rl.test_estimators.one_right_completion"])
    logged = []
    module.log_dict = lambda values, **kwargs: logged.append(values)
    quiet_fit(module, dm, tmp_path)
    assert logged[0]["train/solved_groups"] == 0.25 and logged[0]["train/accuracy"] == 1 / (4 * G)


def test_bad_estimator_settings_are_refused_before_any_rollout(tmp_path):
    dm = data(tmp_path)
    with pytest.raises(ValueError, match="gen_block_length=1"):
        policy(dm, estimator="exact")
    with pytest.raises(ValueError, match="mc_samples=0"):
        policy(dm, estimator="elbo", mc_samples=0)
    with pytest.raises(ValueError, match="estimator='exact_ish'"):
        policy(dm, estimator="exact_ish")
    with pytest.raises(ValueError, match="autoregressive policy's log-probabilities are exact"):
        policy(dm, CausalGRPOModule, estimator="elbo")
    with pytest.raises(ValueError, match="val_trace=True"):
        policy(dm, generation={"gen_length": 4, "val_trace": True})
    with pytest.raises(ValueError, match="update_groups=0"):
        policy(dm, update_groups=0)
    with pytest.raises(ValueError, match="micro_batch_rows=0.*no bound on a micro-batch's rows"):
        policy(dm, micro_batch_rows=0)
    for rl, trainer, message in (({"rollout_temperature": 0.0}, {}, "rollout_temperature=0"),
                                 ({"update_groups": 2}, {}, r"update_groups=2 is not below .*batch_size=2.*"
                                                            r"batch_size=6"),
                                 ({"inner_updates": 2}, {"max_steps": 3}, "max_steps=3 is not a multiple")):
        module = policy(dm, **rl)
        module.sample = lambda *args: pytest.fail("sampled")
        with pytest.raises(ValueError, match=message):
            quiet_fit(module, dm, tmp_path, **{"max_steps": 1, **trainer})


@pytest.mark.parametrize("cls, exported", [(DiffuGRPOModule, "causal_lm"), (CausalGRPOModule, "mdlm")])
def test_an_export_of_another_family_is_refused_as_the_rl_start(tmp_path, cls, exported):
    dm = data(tmp_path)
    other = policy(dm, CausalGRPOModule if exported == "causal_lm" else DiffuGRPOModule)
    other.save_pretrained(tmp_path / "export")
    with pytest.raises(ValueError, match=f"is a {exported} export"):
        policy(dm, cls, backbone={"model": str(tmp_path / "export")})


def test_predict_answers_each_prompt_with_its_rewards(tmp_path):
    dm = data(tmp_path)
    module = policy(dm)
    batch = next(iter(dm.val_dataloader()))
    rows = module.predict_step(batch, 0)
    assert [row["example_index"] for row in rows] == batch["example_index"].tolist()
    assert all(set(row) >= {"prompt", "generated", "reward", "exact_answer"} for row in rows)


def test_the_default_is_the_exact_estimator_on_left_to_right_rollouts(tmp_path):
    dm = data(tmp_path)
    tok = dm.tokenizer
    module = DiffuGRPOModule(vocab_size=len(tok), mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, backbone={"model_config": TINY},
                             rl={"rewards": ["exact_answer"]})
    assert module.estimator == "exact" and module.generation.gen_block_length == 1
