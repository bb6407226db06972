"""Block-diffusion Gemma's log-likelihood bound for evaluation: the per-token integrand of the uniform-noise NELBO
(:func:`uniform_diffusion_nelbo`) and its keyed Monte-Carlo draws over canvas blocks (:func:`block_diffusion_nelbo`);
:meth:`~lit_dllm.families.diffusion_gemma.module.BlockDiffusionGemmaModule.loglikelihood_bound` runs them on the
model."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["block_diffusion_nelbo", "uniform_diffusion_nelbo"]


def uniform_diffusion_nelbo(logits: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor,
                            t: torch.Tensor) -> torch.Tensor:
    r"""Per token, the integrand at time ``t`` of the continuous-time NELBO of uniform-state discrete diffusion.

    The noise (``corrupt_uniform_random``) keeps a token with probability ``α_t = 1 − t``, else redraws it uniformly
    from the ``V`` tokens (possibly itself): ``q_t(z | x) = α_t·[z = x] + (1 − α_t)/V``. That is the marginal of the
    jump process that redraws a token at rate ``β_t = −α'_t/α_t = 1/α_t`` (``z → w ≠ z`` at rate ``β_t/V``). Write
    ``x̄ = V·q_t(·|x) = V·α_t·e_x + 1 − α_t``; the time reversal given ``x`` jumps ``z → w`` at rate ``(β_t/V)·r_w``,
    ``r_w = x̄_w/x̄_z``. The model puts its denoiser ``x_θ(z_t)`` (the softmax of ``logits``) in place of ``e_x``:
    ``r^θ_w = x̄^θ_w/x̄^θ_z``, ``x̄^θ = V·α_t·x_θ + 1 − α_t`` (the continuous-time limit of UDLM's
    ``q(z_s | z_t, x = x_θ)``). The ELBO of a jump process, the path KL between the true and the model's reversal
    (no prior term, since ``q_1`` is uniform, and no reconstruction, since ``z_0 = x``), summed over the tokens,
    which jump one at a time:

        −log p_θ(x) ≤ ∫_0^1 E_{z_t ~ q_t(·|x)} Σ_i f_i dt,
        f = (β_t/V)·Σ_{w≠z} [r^θ_w − r_w − r_w·log(r^θ_w/r_w)] = 1/(V·α_t) · Σ_w r_w·(e^{u_w} − 1 − u_w),
        u_w = log(r^θ_w/r_w)   (the w = z term is 0).

    Summing ``r^θ`` and ``r`` over ``w`` (``Σ_w x̄_w = V``) gives UDLM's continuous-time NELBO (Schiff et al. 2024;
    Sahoo et al. 2025) at ``α'_t = −1``: ``f = 1/(V·α_t)·[V/x̄^θ_z − V/x̄_z + Σ_{w≠z} (x̄_w/x̄_z)·log(x̄_w·x̄^θ_z /
    (x̄_z·x̄^θ_w))]``. The first form is computed here, in log space: each summand is ≥ 0, so nothing large cancels;
    ``f ≥ 0``, and ``f = 0`` for a denoiser with all its mass on ``x``.

    Args:
        logits: ``[..., V]`` denoiser logits.
        noisy, clean: ``[...]`` token ids, ``z_t`` and ``x``.
        t: the noise level of each token (broadcast to ``noisy``), in ``(0, 1)``.
    Returns:
        ``[...]`` the integrand per token, in the logits' dtype (at least fp32).
    """
    vocab = logits.shape[-1]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    alpha = (1 - torch.as_tensor(t, dtype=torch.float64)).expand(noisy.shape)[..., None]
    log_kept, log_redrawn = torch.log(vocab * alpha).to(dtype), torch.log1p(-alpha).to(dtype)

    def log_scaled(log_y: torch.Tensor) -> torch.Tensor:  # log(V·α·y + 1 − α) for a distribution y
        return torch.logaddexp(log_y + log_kept, log_redrawn)

    def log_ratios(log_y: torch.Tensor) -> torch.Tensor:  # log r_w (y = e_x) or log r^θ_w (y = x_θ)
        scaled = log_scaled(log_y)
        return scaled - scaled.gather(-1, noisy[..., None])

    log_r = log_ratios(torch.nn.functional.one_hot(clean, vocab).to(dtype).log())
    u = log_ratios(logits.to(dtype).log_softmax(-1)) - log_r
    return (log_r.exp() * (u.expm1() - u)).sum(-1) / (vocab * alpha[..., 0]).to(dtype)


def block_diffusion_nelbo(nelbo: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], answer: torch.Tensor,
                          length: int, block: int, vocab: int, eps: float, samples: int, batch_size: int,
                          seed: int) -> torch.Tensor:
    """``samples`` Monte-Carlo draws of the block-diffusion NELBO of ``answer[:length]`` (float64, ``[samples]``);
    the model enters only through ``nelbo``, so a toy denoiser can stand in for it.

    ``answer`` holds whole canvas blocks of ``block`` tokens (the real ones, then fill). Each draw takes, per block,
    ``t ~ U(eps, 1)`` and noises each token of the block with it (kept with probability ``1 − t``, else uniform over
    ``vocab``); ``nelbo(canvases, t)`` (``[n, W]`` noised canvases, the ``[n, W]`` level of each token) returns
    :func:`uniform_diffusion_nelbo` at the first ``length`` positions (``[n, length]``). A draw is ``(1 − eps)·Σ f``:
    its mean estimates ``Σ_blocks ∫_eps^1 E[Σ f] dt``. The draws come from a generator seeded with ``seed``, all
    before the first ``nelbo`` call, so they depend neither on ``batch_size`` nor on the device.
    """
    generator = torch.Generator().manual_seed(seed)
    width = len(answer)
    t = eps + (1 - eps) * torch.rand(samples, width // block, generator=generator, dtype=torch.float64)
    t = t.repeat_interleave(block, 1)
    redrawn = torch.rand(samples, width, generator=generator, dtype=torch.float64) < t
    canvases = torch.where(redrawn, torch.randint(vocab, (samples, width), generator=generator), answer)
    sums = [nelbo(canvases[rows], t[rows]).double().sum(1).cpu() for rows in torch.arange(samples).split(batch_size)]
    return (1 - eps) * torch.cat(sums)
