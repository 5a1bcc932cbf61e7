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


def simpo(c, r, beta=2.0, margin=1.0, label_smoothing=0.0):
    c, r = f64(c, r)
    x = beta * c - beta * r - margin
    return -(1 - label_smoothing) * log_sigmoid(x) - label_smoothing * log_sigmoid(-x)


def cpo(c, r, beta=0.1, label_smoothing=0.0, nll_weight=1.0, chosen_nll=None):
    c, r = f64(c, r)
    x = beta * (c - r)
    nll = -c if chosen_nll is None else np.asarray(chosen_nll, np.float64)
    return (
        -(1 - label_smoothing) * log_sigmoid(x)
        - label_smoothing * log_sigmoid(-x)
        + nll_weight * nll
    )


def log_odds(logp):
    """log(p / (1 - p)) for p = exp(logp), with 1 - p from expm1 to keep it exact near p = 1."""
    logp = np.asarray(logp, np.float64)
    return logp - np.log(-np.expm1(logp))


def orpo_log_odds_ratio(c, r):
    return log_odds(c) - log_odds(r)


def orpo(c, r, odds_ratio_weight=0.1, chosen_nll=None):
    c, r = f64(c, r)
    nll = -c if chosen_nll is None else np.asarray(chosen_nll, np.float64)
    return nll - odds_ratio_weight * log_sigmoid(orpo_log_odds_ratio(c, r))


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
