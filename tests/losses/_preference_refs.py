"""Float64 NumPy references for the preference losses, written from each paper's formula.

Every reference works row by row on float64 copies of its inputs and shares no code with
`tunelib`. `h` is the DPO margin, `r_w` and `r_l` the chosen and rejected log-ratios.
"""

import numpy as np


def f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def log_sigmoid(x):
    """log(1 / (1 + e^-x)) without overflow: -log(1 + e^-x) = -logaddexp(0, -x)."""
    return -np.logaddexp(0.0, -np.asarray(x, np.float64))


def sigmoid(x):
    return np.exp(log_sigmoid(x))


def margin(c, r, rc, rr):
    c, r, rc, rr = f64(c, r, rc, rr)
    return (c - r) - (rc - rr)


def dpo(c, r, rc, rr, beta=0.1, label_smoothing=0.0):
    # Cross-entropy of the Bradley-Terry probability sigma(beta h) against the soft label
    # (1 - eps, eps).
    x = beta * margin(c, r, rc, rr)
    return -(1 - label_smoothing) * log_sigmoid(x) - label_smoothing * log_sigmoid(-x)


def robust_dpo(c, r, rc, rr, beta=0.1, label_smoothing=0.1):
    # rDPO, Chowdhury et al. eq. (8): [(1 - eps) l(h) - eps l(-h)] / (1 - 2 eps), l = -logsig.
    x, eps = beta * margin(c, r, rc, rr), label_smoothing
    return ((1 - eps) * -log_sigmoid(x) - eps * -log_sigmoid(-x)) / (1 - 2 * eps)


def ipo(c, r, rc, rr, beta=0.1):
    return (margin(c, r, rc, rr) - 1 / (2 * beta)) ** 2


def hinge(c, r, rc, rr, beta=0.1):
    return np.maximum(0.0, 1 - beta * margin(c, r, rc, rr))


def exo(c, r, rc, rr, beta=0.1, label_smoothing=1e-3):
    # KL(p_theta || p_label) over the two outcomes {y_w wins, y_l wins}.
    x = beta * margin(c, r, rc, rr)
    p_win, p_lose = sigmoid(x), sigmoid(-x)
    q_win, q_lose = 1 - label_smoothing, label_smoothing
    return p_win * (log_sigmoid(x) - np.log(q_win)) + p_lose * (log_sigmoid(-x) - np.log(q_lose))


def discopop(c, r, rc, rr, beta=0.05, tau=0.05):
    rho = beta * margin(c, r, rc, rr)
    gate = sigmoid(rho / tau)
    # gate * exp(-rho) written in logs: no overflow for very negative rho.
    return (1 - gate) * -log_sigmoid(rho) + np.exp(log_sigmoid(rho / tau) - rho)


def length_normalized_dpo(c, r, rc, rr, len_c, len_r, beta=5.0):
    c, r, rc, rr, len_c, len_r = f64(c, r, rc, rr, len_c, len_r)
    return dpo(c / len_c, r / len_r, rc / len_c, rr / len_r, beta=beta)


def log_ratios(c, r, rc, rr):
    c, r, rc, rr = f64(c, r, rc, rr)
    return c - rc, r - rr


def nca(c, r, rc, rr, beta=0.1):
    r_w, r_l = log_ratios(c, r, rc, rr)
    return (
        -log_sigmoid(beta * r_w) - 0.5 * log_sigmoid(-beta * r_w) - 0.5 * log_sigmoid(-beta * r_l)
    )


def bco_pair(c, r, rc, rr, beta=0.1, delta=0.0):
    r_w, r_l = log_ratios(c, r, rc, rr)
    # Binary cross-entropy: chosen has label 1, rejected label 0, logit = reward - delta.
    return -log_sigmoid(beta * r_w - delta) - log_sigmoid(-(beta * r_l - delta))


def sppo_hard(c, r, rc, rr, beta=0.1):
    r_w, r_l = log_ratios(c, r, rc, rr)
    eta = 1 / beta
    return (r_w - eta * (1 - 0.5)) ** 2 + (r_l - eta * (0 - 0.5)) ** 2


def apo_zero(c, r, rc, rr, beta=0.1):
    r_w, r_l = log_ratios(c, r, rc, rr)
    return (1 - sigmoid(beta * r_w)) + sigmoid(beta * r_l)


def apo_down(c, r, rc, rr, beta=0.1):
    r_w, r_l = log_ratios(c, r, rc, rr)
    return sigmoid(beta * r_w) + (1 - sigmoid(beta * (r_w - r_l)))


def aot(c, r, rc, rr, beta=0.1, label_smoothing=0.0, paired=False):
    """Per rank, over all rows given (the caller drops masked rows first)."""
    c, r, rc, rr = f64(c, r, rc, rr)
    if paired:
        u, w = np.sort(c - r), np.sort(rc - rr)
    else:
        u, w = np.sort(c - rc), np.sort(r - rr)
    x = beta * (u - w)
    return -(1 - label_smoothing) * log_sigmoid(x) - label_smoothing * log_sigmoid(-x)


def alpha_reward(x, alpha):
    """(1 - u^-alpha) / alpha for u = e^x, and x itself at alpha = 0; the exponent -alpha x is
    capped at 80 as the documented formula says."""
    x = np.asarray(x, np.float64)
    if alpha == 0:
        return x
    return -np.expm1(np.minimum(-alpha * x, 80.0)) / alpha


def simpo(c, r, beta=2.0, margin=1.0, label_smoothing=0.0, reward_shape=0.0):
    # AlphaPO (Gupta et al. 2025): the reward of a mean log-prob l is (1 - e^(-alpha l)) / alpha.
    c, r = f64(c, r)
    x = beta * (alpha_reward(c, reward_shape) - alpha_reward(r, reward_shape)) - margin
    return -(1 - label_smoothing) * log_sigmoid(x) - label_smoothing * log_sigmoid(-x)


def cpo(c, r, beta=0.1, label_smoothing=0.0, nll_weight=1.0, chosen_nll=None, reward_shape=0.0):
    c, r = f64(c, r)
    x = beta * (alpha_reward(c, reward_shape) - alpha_reward(r, reward_shape))
    nll = -c if chosen_nll is None else np.asarray(chosen_nll, np.float64)
    return (
        -(1 - label_smoothing) * log_sigmoid(x)
        - label_smoothing * log_sigmoid(-x)
        + nll_weight * nll
    )


def trl_cpo_batch_loss(chosen_tokens, rejected_tokens, chosen_mask, rejected_mask, beta, cpo_alpha):
    """TRL 1.16's CPOTrainer loss for loss_type="sigmoid", label_smoothing 0, from per-token
    log-probs: the mean over pairs of -log sigmoid(beta (sum_w - sum_l)), plus cpo_alpha times
    the cross-entropy of the chosen completions, one mean over all their non-ignored tokens."""
    chosen_tokens, rejected_tokens = f64(chosen_tokens, rejected_tokens)
    chosen_mask, rejected_mask = np.asarray(chosen_mask, bool), np.asarray(rejected_mask, bool)
    sums_w = np.array([row[m].sum() for row, m in zip(chosen_tokens, chosen_mask, strict=True)])
    sums_l = np.array([row[m].sum() for row, m in zip(rejected_tokens, rejected_mask, strict=True)])
    preference = np.mean(-log_sigmoid(beta * (sums_w - sums_l)))
    cross_entropy = -chosen_tokens[chosen_mask].sum() / chosen_mask.sum()
    return preference + cpo_alpha * cross_entropy


def log_odds(logp):
    """log(p / (1 - p)) for p = exp(logp), with 1 - p from expm1 to keep it exact near p = 1."""
    logp = np.asarray(logp, np.float64)
    return logp - np.log(-np.expm1(logp))


def orpo_log_odds_ratio(c, r):
    return log_odds(c) - log_odds(r)


def orpo(c, r, odds_ratio_weight=0.1, chosen_nll=None, label_smoothing=0.0):
    # Tunix's label smoothing: cross-entropy of sigmoid(o) against the labels (1 - eps, eps).
    c, r = f64(c, r)
    nll = -c if chosen_nll is None else np.asarray(chosen_nll, np.float64)
    o = orpo_log_odds_ratio(c, r)
    smoothed = -(1 - label_smoothing) * log_sigmoid(o) - label_smoothing * log_sigmoid(-o)
    return nll + odds_ratio_weight * smoothed


def kto_reference_point(kl_logps, ref_kl_logps):
    kl_logps, ref_kl_logps = f64(kl_logps, ref_kl_logps)
    if kl_logps.size == 0:
        return 0.0
    return max(0.0, float(np.mean(kl_logps - ref_kl_logps)))


def kto(logps, ref_logps, desirable, reference_point, beta=0.1, w_d=1.0, w_u=1.0):
    logps, ref_logps = f64(logps, ref_logps)
    r = logps - ref_logps
    value_d = w_d * sigmoid(beta * (r - reference_point))
    value_u = w_u * sigmoid(beta * (reference_point - r))
    # KTO's loss is lambda_y - v(x, y).
    return np.where(desirable, w_d - value_d, w_u - value_u)


def bradley_terry(chosen, rejected, margin=0.0, centering_weight=0.0):
    chosen, rejected = f64(chosen, rejected)
    nll = -log_sigmoid(chosen - rejected - np.asarray(margin, np.float64))
    return nll + centering_weight * (chosen + rejected) ** 2


def implicit_rewards(logps, ref_logps, beta):
    logps, ref_logps = f64(logps, ref_logps)
    return beta * (logps - ref_logps)


def preference_accuracy(chosen, rejected):
    chosen, rejected = f64(chosen, rejected)
    if chosen.size == 0:
        return 0.0
    return float(np.mean(chosen > rejected))


# f-DPO (Wang et al. 2023, Table 1): f'(u) of each divergence at u = pi / pi_ref.


def f_prime(u, divergence, alpha=0.5):
    u = np.asarray(u, np.float64)
    if divergence == "reverse_kl":
        return np.log(u)  # + 1, which cancels in every difference
    if divergence == "forward_kl":
        return 1 - 1 / u
    if divergence == "jsd":
        return np.log(2 * u / (1 + u))
    if alpha == 0:  # the limit: the reverse KL
        return np.log(u)
    # (1 - u^-alpha) / alpha, with u^-alpha - 1 from expm1 so that tiny alpha keeps its digits.
    return -np.expm1(-alpha * np.log(u)) / alpha


def f_dpo_scores(logps, ref_logps, divergence="reverse_kl", alpha=0.5):
    logps, ref_logps = f64(logps, ref_logps)
    return f_prime(np.exp(logps - ref_logps), divergence, alpha)


def f_dpo(c, r, rc, rr, beta=0.1, divergence="reverse_kl", alpha=0.5):
    s_w = f_dpo_scores(c, rc, divergence, alpha)
    s_l = f_dpo_scores(r, rr, divergence, alpha)
    return -log_sigmoid(beta * (s_w - s_l))


# LD-DPO (Liu et al. 2024) and WPO (Zhou et al. 2024), on per-token rows with masks.


def ld_logps(chosen_tokens, rejected_tokens, chosen_mask, rejected_mask, tail_weight):
    """Per pair: the valid tokens of each completion in order; the first min(|y_w|, |y_l|) in
    full, the rest times tail_weight."""
    chosen_out, rejected_out = [], []
    rows = zip(chosen_tokens, rejected_tokens, chosen_mask, rejected_mask, strict=True)
    for c, r, mc, mr in rows:
        c = np.asarray(c, np.float64)[np.asarray(mc, bool)]
        r = np.asarray(r, np.float64)[np.asarray(mr, bool)]
        shared = min(len(c), len(r))
        chosen_out.append(c[:shared].sum() + tail_weight * c[shared:].sum())
        rejected_out.append(r[:shared].sum() + tail_weight * r[shared:].sum())
    return np.array(chosen_out), np.array(rejected_out)


def ld_dpo(c, r, rc, rr, chosen_mask, rejected_mask, tail_weight, beta=0.1):
    pi_w, pi_l = ld_logps(c, r, chosen_mask, rejected_mask, tail_weight)
    ref_w, ref_l = ld_logps(rc, rr, chosen_mask, rejected_mask, tail_weight)
    return dpo(pi_w, pi_l, ref_w, ref_l, beta=beta)


def wpo_weights(c, r, c_norms, r_norms, chosen_mask, rejected_mask, max_weight=1.0):
    """WPO's eq. (2) with sampled alignment, per pair; an empty completion has weight 1."""

    def weight(tokens, norms, mask):
        mask = np.asarray(mask, bool)
        aligned = np.asarray(tokens, np.float64)[mask] - np.asarray(norms, np.float64)[mask]
        return np.exp(aligned.mean()) if aligned.size else 1.0

    out = []
    for row in zip(c, r, c_norms, r_norms, chosen_mask, rejected_mask, strict=True):
        w = weight(row[0], row[2], row[4]) * weight(row[1], row[3], row[5])
        out.append(w if max_weight is None else min(w, max_weight))
    return np.array(out)
