"""The algorithms of docs/losses/rl.md, built from tunelib pieces, against their papers.

The page's code is executed as written; every algorithm is then evaluated on fresh random
batches and compared with a float64 NumPy implementation of the paper's objective, written
sequence by sequence and token by token.
"""

import doctest
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import assert_close

PAGE = Path(__file__).resolve().parents[2] / "docs" / "losses" / "rl.md"


@pytest.fixture(scope="module")
def page() -> dict:
    """The namespace the page's examples build, run as the doctest runs them."""
    namespace: dict = {}
    test = doctest.DocTestParser().get_doctest(PAGE.read_text(), namespace, "rl", str(PAGE), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test, clear_globs=False)
    assert runner.failures == 0
    return test.globs


def new_batch(page: dict, seed: int) -> dict:
    """Random data of the page's shapes, bound into its namespace."""
    rng = np.random.default_rng(seed)
    p, g, t = page["P"], page["G"], page["T"]
    n = p * g
    lengths = rng.integers(1, t + 1, n)
    rewards = rng.integers(0, 2, (p, g)).astype(np.float32)
    rewards[0] = 1.0  # always one group without spread
    data = {
        "token_logps": rng.normal(-1.0, 0.5, (n, t)).astype(np.float32),
        "lengths": lengths,
        "rewards": rewards,
        "values": rng.normal(0.3, 0.2, (n, t)).astype(np.float32),
    }
    data["old_token_logps"] = data["token_logps"] + rng.normal(0, 0.3, (n, t)).astype(np.float32)
    data["ref_token_logps"] = data["token_logps"] + rng.normal(0, 0.3, (n, t)).astype(np.float32)
    data["old_values"] = data["values"] + rng.normal(0, 0.15, (n, t)).astype(np.float32)
    page.update({k: jnp.asarray(v) for k, v in data.items()})
    page["where"] = jnp.arange(t)[None, :] < page["lengths"][:, None]
    return {k: np.asarray(v, np.float64) for k, v in data.items()}


def group_normalised(rewards, *, divide=True, eps=1e-4):
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if not divide:
        return centred
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    return np.where(std > 0, centred / (std + eps), 0.0)


def clipped(ratio, adv, low, high):
    return min(ratio * adv, np.clip(ratio, 1 - low, 1 + high) * adv)


def ref_grpo(d, beta=0.04, eps=0.2):
    adv = group_normalised(d["rewards"]).reshape(-1)
    per_sequence = []
    for i, n in enumerate(d["lengths"].astype(int)):
        terms = []
        for t in range(n):
            lp, old, ref = (
                d["token_logps"][i, t],
                d["old_token_logps"][i, t],
                d["ref_token_logps"][i, t],
            )
            kl = np.exp(ref - lp) - (ref - lp) - 1  # the k3 estimator of the paper's eq. 4
            terms.append(-clipped(np.exp(lp - old), adv[i], eps, eps) + beta * kl)
        per_sequence.append(np.mean(terms))
    return np.mean(per_sequence)


def ref_dapo(d, max_length=5, buffer_length=2, low=0.2, high=0.28):
    lengths = d["lengths"].astype(int)
    penalty = np.where(
        lengths <= max_length - buffer_length,
        0.0,
        np.where(
            lengths <= max_length, (max_length - buffer_length - lengths) / buffer_length, -1.0
        ),
    )
    g = d["rewards"].shape[1]
    shaped = d["rewards"] + penalty.reshape(-1, g)
    adv = group_normalised(shaped).reshape(-1)
    keep = np.repeat(d["rewards"].max(axis=1) > d["rewards"].min(axis=1), g)
    terms = [
        -clipped(np.exp(d["token_logps"][i, t] - d["old_token_logps"][i, t]), adv[i], low, high)
        for i, n in enumerate(lengths)
        if keep[i]
        for t in range(n)
    ]
    return np.mean(terms) if terms else 0.0


def ref_dr_grpo(d, max_tokens=5, eps=0.2):
    adv = group_normalised(d["rewards"], divide=False).reshape(-1)
    sums = [
        sum(
            -clipped(np.exp(d["token_logps"][i, t] - d["old_token_logps"][i, t]), adv[i], eps, eps)
            for t in range(n)
        )
        for i, n in enumerate(d["lengths"].astype(int))
    ]
    return np.mean(sums) / max_tokens


def ref_gspo(d, low=3e-4, high=4e-4):
    adv = group_normalised(d["rewards"]).reshape(-1)
    out = []
    for i, n in enumerate(d["lengths"].astype(int)):
        s = np.exp(np.mean(d["token_logps"][i, :n] - d["old_token_logps"][i, :n]))
        out.append(-clipped(s, adv[i], low, high))
    return np.mean(out)


def ref_cispo(d, low=1.0, high=2.0):
    adv = group_normalised(d["rewards"]).reshape(-1)
    terms = [
        -np.clip(np.exp(d["token_logps"][i, t] - d["old_token_logps"][i, t]), 1 - low, 1 + high)
        * adv[i]
        * d["token_logps"][i, t]
        for i, n in enumerate(d["lengths"].astype(int))
        for t in range(n)
    ]
    return np.mean(terms)


def sequence_ratio(d, i, n):
    """GSPO's s_i: the exponential of the mean token log-ratio of sequence i."""
    return np.exp(np.mean(d["token_logps"][i, :n] - d["old_token_logps"][i, :n]))


def ref_cispo_sequence(d, cap=5.0):
    """TRL's CISPO at sequence level: -min(s_i, cap) A_i log pi_t, token mean."""
    adv = group_normalised(d["rewards"]).reshape(-1)
    terms = [
        -min(sequence_ratio(d, i, n), cap) * adv[i] * d["token_logps"][i, t]
        for i, n in enumerate(d["lengths"].astype(int))
        for t in range(n)
    ]
    return np.mean(terms)


def ref_sapo_sequence(d, tau_pos=1.0, tau_neg=1.05):
    """SAPO's gate of s_i, one term per sequence: -(4 / tau) sigmoid(tau (s_i - 1)) A_i."""
    adv = group_normalised(d["rewards"]).reshape(-1)
    out = []
    for i, n in enumerate(d["lengths"].astype(int)):
        tau = tau_pos if adv[i] > 0 else tau_neg
        gate = 4 / tau / (1 + np.exp(-tau * (sequence_ratio(d, i, n) - 1)))
        out.append(-gate * adv[i])
    return np.mean(out)


def ref_vespo(d, k=(2.0, 3.0), lam=(3.0, 2.0)):
    """VESPO: -phi(w_i) A_i log pi_t with w_i the product of the token ratios, token mean."""
    adv = group_normalised(d["rewards"]).reshape(-1)
    terms = []
    for i, n in enumerate(d["lengths"].astype(int)):
        w = np.prod(np.exp(d["token_logps"][i, :n] - d["old_token_logps"][i, :n]))
        j = 0 if adv[i] >= 0 else 1
        phi = w ** k[j] * np.exp(lam[j] * (1 - w))
        terms += [-phi * adv[i] * d["token_logps"][i, t] for t in range(n)]
    return np.mean(terms)


def ref_luspo(d, low=3e-4, high=4e-4):
    """LUSPO: (1/G) sum_i |y_i| (-min(s_i A_i, clip(s_i) A_i))."""
    adv = group_normalised(d["rewards"]).reshape(-1)
    lengths = d["lengths"].astype(int)
    return np.mean(
        [n * -clipped(sequence_ratio(d, i, n), adv[i], low, high) for i, n in enumerate(lengths)]
    )


def ref_grpo_off_policy(d, beta=0.04, eps=0.2, delta=0.05):
    """GRPO with DeepSeek-V3.2's off-policy sequence mask (eq. 9) on the policy term and the
    importance-weighted k3 (pi_theta / pi_old) k3_t."""
    adv = group_normalised(d["rewards"]).reshape(-1)
    per_sequence = []
    for i, n in enumerate(d["lengths"].astype(int)):
        lp, old, ref = (d[k][i, :n] for k in ("token_logps", "old_token_logps", "ref_token_logps"))
        keep = not (adv[i] < 0 and np.mean(old - lp) > delta)
        terms = [
            -clipped(np.exp(lp[t] - old[t]), adv[i], eps, eps) * keep
            + beta * np.exp(lp[t] - old[t]) * (np.exp(ref[t] - lp[t]) - (ref[t] - lp[t]) - 1)
            for t in range(n)
        ]
        per_sequence.append(np.mean(terms))
    return np.mean(per_sequence)


def ref_ppo(d, beta=0.05, gamma=1.0, lam=0.95, value_coef=0.5, eps=0.2):
    lengths = d["lengths"].astype(int)
    score = d["rewards"].reshape(-1)
    advs, rets = {}, {}
    for i, n in enumerate(lengths):
        old, ref, v_old = d["old_token_logps"][i], d["ref_token_logps"][i], d["old_values"][i]
        r = [-beta * (old[t] - ref[t]) + (score[i] if t == n - 1 else 0.0) for t in range(n)]
        a = 0.0
        for t in reversed(range(n)):
            next_value = v_old[t + 1] if t + 1 < n else 0.0
            a = r[t] + gamma * next_value - v_old[t] + gamma * lam * a
            advs[i, t], rets[i, t] = a, a + v_old[t]
    flat = np.array(list(advs.values()))
    mean, std = flat.mean(), np.sqrt(flat.var(ddof=1) + 1e-8)
    terms = []
    for (i, t), a in advs.items():
        a = (a - mean) / std
        ratio = np.exp(d["token_logps"][i, t] - d["old_token_logps"][i, t])
        v, v_old, ret = d["values"][i, t], d["old_values"][i, t], rets[i, t]
        vf = 0.5 * max((v - ret) ** 2, (np.clip(v, v_old - eps, v_old + eps) - ret) ** 2)
        terms.append(-clipped(ratio, a, eps, eps) + value_coef * vf)
    return np.mean(terms)


@pytest.mark.parametrize("seed", range(4))
def test_each_algorithm_matches_its_paper(page, seed):
    d = new_batch(page, seed)
    logps = page["token_logps"]
    assert_close(page["grpo"](logps), ref_grpo(d), rtol=1e-5, atol=1e-6)
    assert_close(page["dapo"](logps), ref_dapo(d), rtol=1e-5, atol=1e-6)
    assert_close(page["dr_grpo"](logps), ref_dr_grpo(d), rtol=1e-5, atol=1e-6)
    assert_close(page["gspo"](logps), ref_gspo(d), rtol=1e-5, atol=1e-6)
    assert_close(page["cispo"](logps), ref_cispo(d), rtol=1e-5, atol=1e-6)
    assert_close(page["cispo_sequence"](logps), ref_cispo_sequence(d), rtol=1e-5, atol=1e-6)
    assert_close(page["sapo_sequence"](logps), ref_sapo_sequence(d), rtol=1e-5, atol=1e-6)
    assert_close(page["vespo"](logps), ref_vespo(d), rtol=1e-5, atol=1e-6)
    assert_close(page["luspo"](logps), ref_luspo(d), rtol=1e-5, atol=1e-6)
    assert_close(page["grpo_off_policy"](logps), ref_grpo_off_policy(d), rtol=1e-5, atol=1e-6)
    assert_close(page["ppo"](logps, page["values"]), ref_ppo(d), rtol=1e-4, atol=1e-5)


def test_the_off_policy_mask_drops_sequences_on_the_page(page):
    """The threshold of the page's example binds: some sequences are dropped, not all."""
    dropped = []
    for seed in range(4):
        d = new_batch(page, seed)
        adv = group_normalised(d["rewards"]).reshape(-1)
        for i, n in enumerate(d["lengths"].astype(int)):
            drift = np.mean(d["old_token_logps"][i, :n] - d["token_logps"][i, :n])
            dropped.append(adv[i] < 0 and drift > 0.05)
    assert 0 < sum(dropped) < len(dropped)
