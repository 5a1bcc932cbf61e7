r"""Controllers with state, in Optax's form: KL and entropy coefficients that steer themselves
toward a target, KTO's running reference point, and running reward statistics.

Each factory returns a NamedTuple of pure functions over a NamedTuple state of float32 (and
int32) scalars: `init()` gives the first state and `update(measurement, state, ...)` the next.
They run under `jax.jit` and `lax.scan`; numeric hyperparameters may be traced (build the
controller inside the jitted step). A measurement with no valid entry, or whose mean is NaN or
infinite, leaves the state as it is.
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Real

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses import kto_reference_point

EntropyRule = Literal["additive", "log"]
_ENTROPY_RULES: tuple[str, ...] = EntropyRule.__args__
Average = Literal["ema", "mean"]
_AVERAGES: tuple[str, ...] = Average.__args__

# The proportional error of the adaptive KL controller is clipped to [-0.2, 0.2] (Ziegler et
# al. 2019, section 2.2; TRL and verl keep the constant).
_KL_ERROR_CLIP = 0.2


class Controller(NamedTuple):
    """A stateful controller as a pair of pure functions, like `optax.GradientTransformation`.

    Attributes:
      init: `init() -> state`, the state before any measurement.
      update: `update(measurement, state, ...) -> state`, the state after one measurement.
    """

    init: Callable[[], Any]
    update: Callable[..., Any]


class KLControllerState(NamedTuple):
    """The KL coefficient to use in the next step (float32 scalar)."""

    kl_coef: jax.Array


class EntropyControllerState(NamedTuple):
    """The entropy weight to use in the next step, and the level it is set from.

    `entropy_weight` goes to `tunelib.losses.entropy_bonus`. `level` is the controller's own
    coefficient ($c$): with ``rule="log"`` the two are equal; with ``rule="additive"`` the
    weight is the level while the entropy is below the target and 0 otherwise.
    """

    entropy_weight: jax.Array
    level: jax.Array


class ReferencePointState(NamedTuple):
    """The running reference point (float32 scalar) and the number of batches it averages."""

    reference_point: jax.Array
    count: jax.Array


class RunningMomentsState(NamedTuple):
    """Running moments of every valid value seen: their number (int32), mean and sum of
    squared deviations from the mean (float32); the variance is `m2 / (count - ddof)`."""

    count: jax.Array
    mean: jax.Array
    m2: jax.Array


class RewardNormalizer(NamedTuple):
    """The functions of a running reward normaliser.

    Attributes:
      init: `init() -> RunningMomentsState`, no value seen.
      update: `update(rewards, state, *, where=None) -> RunningMomentsState`.
      merge: `merge(state_a, state_b) -> RunningMomentsState`, the moments of both together.
      normalize: `normalize(rewards, state, *, where=None) -> rewards`, normalised.
    """

    init: Callable[[], RunningMomentsState]
    update: Callable[..., RunningMomentsState]
    merge: Callable[[RunningMomentsState, RunningMomentsState], RunningMomentsState]
    normalize: Callable[..., Array]


def _measurement(x: ArrayLike, where: ArrayLike | None, name: str) -> tuple[Array, Array]:
    """The float32 mean of `x` over the entries `where` keeps (all when None; a scalar is its
    own mean), and whether it may be used: at least one valid entry and a finite mean."""
    x = v.real_array(x, name)
    where = v.mask_array(where, x.shape)
    x = jnp.where(where, x.astype(jnp.float32), 0.0)  # NaN at a valid entry stays NaN
    count = jnp.sum(where)
    mean = jnp.sum(x) / jnp.maximum(count, 1).astype(jnp.float32)
    return mean, (count > 0) & jnp.isfinite(mean)


def _keep_if(ok: Array, new: tuple, old: tuple) -> Any:
    """`new` where `ok`, else `old`, leaf by leaf, in the dtypes of `old`."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o).astype(o.dtype), new, old)


def adaptive_kl_controller(
    *, init_kl_coef: Scalar, target_kl: Scalar, horizon: Scalar = 10000
) -> Controller:
    r"""The adaptive KL controller of Ziegler et al. (2019): the KL coefficient moves the
    measured KL toward a target.

    $$
    e_t = \operatorname{clip}\!\Big(\frac{\mathrm{KL}_t}{\mathrm{KL}_{\mathrm{target}}} - 1,
        -0.2,\ 0.2\Big), \qquad
    \beta_{t+1} = \beta_t \Big(1 + e_t \, \frac{n_t}{H}\Big), \qquad \beta_0 = \beta_{\mathrm{init}}
    $$

    with $\mathrm{KL}_t$ the mean of `kl` over its valid entries, $\mathrm{KL}_{\mathrm{target}}$
    = `target_kl`, $n_t$ = `n_steps`, $H$ = `horizon`, $\beta_{\mathrm{init}}$ =
    `init_kl_coef` and $\beta_t$ = `state.kl_coef` (the `kl_coef` of
    `kl_reward_shaping`). The paper writes the gain as $K_\beta = 0.1$; its code (and TRL's
    `AdaptiveKLController`, up to TRL 0.13, and verl's) uses $K_\beta = n_t / H$, with $n_t$
    the number of episodes the KL was measured on (TRL passes the global batch size, batch
    size times processes; verl its batch size) and $H = 10^4$, as here. Keep $n_t / H < 5$,
    or a KL far below target makes $\beta$ negative.

    The KL is measured however the trainer logs it: TRL's PPO takes the batch mean of each
    sequence's summed per-token KL, verl the batch mean of each sequence's token-mean KL;
    `target_kl` must be in the same units. `update` averages the entries of `kl` it is given
    (a scalar, or one value per sequence with `where`).

    `init() -> KLControllerState(kl_coef=init_kl_coef)`;
    `update(kl, state, *, n_steps, where=None) -> KLControllerState`. A `kl` with no valid
    entry, or whose mean is NaN or infinite, leaves the state unchanged.

    Args:
      init_kl_coef: $\beta_0 \ge 0$; may be traced.
      target_kl: $\mathrm{KL}_{\mathrm{target}} > 0$, in the units `kl` is measured in (TRL's
        PPO default was 6 nats per sequence); may be traced.
      horizon: $H > 0$ (default $10^4$, as the paper's code, TRL and verl); may be traced.

    Returns:
      A `Controller`. Its `update` takes `kl` `[...]` (float or integer), the state,
      `n_steps` ($n_t > 0$, keyword, may be traced) and `where` `[...]` (True or 1 = counts;
      None = every entry).

    Examples:
      >>> from tunelib.advantages import adaptive_kl_controller
      >>> controller = adaptive_kl_controller(init_kl_coef=0.2, target_kl=6.0)
      >>> state = controller.init()
      >>> state = controller.update(9.0, state, n_steps=512)  # e = clip(0.5) = 0.2
      >>> print(state.kl_coef)
      0.202048
      >>> state = controller.update(float("nan"), state, n_steps=512)  # skipped
      >>> print(state.kl_coef)
      0.202048

    References:
      Ziegler et al., "Fine-Tuning Language Models from Human Preferences", 2019,
      https://arxiv.org/abs/1909.08593.
    """
    v.non_negative(init_kl_coef, "init_kl_coef")
    v.positive_scalar(target_kl, "target_kl")
    v.positive_scalar(horizon, "horizon")

    def init() -> KLControllerState:
        return KLControllerState(kl_coef=jnp.asarray(init_kl_coef, jnp.float32))

    def update(
        kl: Real[ArrayLike, "*B"],
        state: KLControllerState,
        *,
        n_steps: Scalar,
        where: Mask[ArrayLike, "*B"] | None = None,
    ) -> KLControllerState:
        v.positive_scalar(n_steps, "n_steps")
        measured, ok = _measurement(kl, where, "kl")
        target = jnp.asarray(target_kl, jnp.float32)
        error = jnp.clip(measured / target - 1.0, -_KL_ERROR_CLIP, _KL_ERROR_CLIP)
        gain = jnp.asarray(n_steps, jnp.float32) / jnp.asarray(horizon, jnp.float32)
        return _keep_if(ok, KLControllerState(state.kl_coef * (1.0 + error * gain)), state)

    return Controller(init, update)


def fixed_kl_controller(*, kl_coef: Scalar) -> Controller:
    r"""A KL coefficient that stays where it is: $\beta_t = \beta$ for every $t$.

    with $\beta$ = `kl_coef`. It has the form of `adaptive_kl_controller` (TRL's
    `FixedKLController` beside its adaptive one), so that a trainer can switch between the
    two without other changes: `init() -> KLControllerState(kl_coef=kl_coef)` and
    `update(kl, state, *, n_steps=None, where=None)` returns `state` (it checks `kl`'s
    mask like the adaptive one, and ignores its values).

    Args:
      kl_coef: $\beta \ge 0$; may be traced.

    Returns:
      A `Controller`.

    Examples:
      >>> from tunelib.advantages import fixed_kl_controller
      >>> controller = fixed_kl_controller(kl_coef=0.05)
      >>> state = controller.update(9.0, controller.init(), n_steps=512)
      >>> print(state.kl_coef)
      0.05

    References:
      Ziegler et al., "Fine-Tuning Language Models from Human Preferences", 2019,
      https://arxiv.org/abs/1909.08593.
    """
    v.non_negative(kl_coef, "kl_coef")

    def init() -> KLControllerState:
        return KLControllerState(kl_coef=jnp.asarray(kl_coef, jnp.float32))

    def update(
        kl: Real[ArrayLike, "*B"],
        state: KLControllerState,
        *,
        n_steps: Scalar | None = None,
        where: Mask[ArrayLike, "*B"] | None = None,
    ) -> KLControllerState:
        if n_steps is not None:
            v.positive_scalar(n_steps, "n_steps")
        _measurement(kl, where, "kl")
        return state

    return Controller(init, update)


def adaptive_entropy_controller(
    *,
    target_entropy: Scalar,
    init_entropy_weight: Scalar = 0.0,
    rule: EntropyRule = "additive",
    step_size: Scalar = 1e-4,
    min_entropy_weight: Scalar = 0.0,
    max_entropy_weight: Scalar | None = 0.005,
) -> Controller:
    r"""An entropy weight that steers the policy's entropy toward a target.

    With $H_t$ the mean of `entropy` over its valid entries, $\bar H$ = `target_entropy`,
    $\delta$ = `step_size`, $c_0$ = `init_entropy_weight`, $[c_{\min}, c_{\max}]$ =
    [`min_entropy_weight`, `max_entropy_weight`], $c_t$ = `state.level` and $\alpha_t$ =
    `state.entropy_weight` (the `entropy_weight` of `tunelib.losses.entropy_bonus`), `rule`
    chooses the update:

    * ``"additive"`` (default; Skywork-OR1's adaptive entropy control, He et al. 2025, as in
      its code): a fixed step up while the entropy is below the target and down otherwise, and
      the bonus switched off while the entropy is above the target:

      $$
      c_{t+1} = \operatorname{clip}\big(c_t + \delta \,(+1 \text{ if } H_t < \bar H
          \text{ else } -1),\ c_{\min},\ c_{\max}\big), \qquad
      \alpha_{t+1} = c_{t+1} \, \mathbb{1}[H_t < \bar H]
      $$

      Skywork-OR1 uses $\bar H = 0.2$, $\delta = 10^{-4}$, $c_0 = 0$, $c_{\min} = 0$ and
      $c_{\max} = 0.005$: the defaults here, but for $\bar H$, which has none.
    * ``"log"`` (the temperature of soft actor-critic, Haarnoja et al. 2018, as the common
      implementations write it, with $\log \alpha$ the variable and one plain gradient step
      of rate $\delta$ on the loss $\log \alpha \, (H_t - \bar H)$): a multiplicative step,

      $$
      c_{t+1} = \operatorname{clip}\big(c_t \, e^{\delta (\bar H - H_t)},\ c_{\min},\
          c_{\max}\big), \qquad \alpha_{t+1} = c_{t+1}
      $$

      so $c_0$ must be $> 0$. SAC implementations take Adam steps on $\log \alpha$ and do not
      clip; pass `max_entropy_weight=None` for no upper bound, and choose $\delta$ for this
      rule (in nats$^{-1}$; $10^{-4}$ barely moves).

    Skywork-OR1 measures $H_t$ as the token mean of the entropy in the step's policy loss:
    pass the `[B, T]` per-token entropies with the completion mask, or their mean.

    `init() -> EntropyControllerState(entropy_weight=c_0, level=c_0)`;
    `update(entropy, state, *, where=None) -> EntropyControllerState`. An `entropy` with no
    valid entry, or whose mean is NaN or infinite, leaves the state unchanged.

    Args:
      target_entropy: $\bar H$, in nats; may be traced.
      init_entropy_weight: $c_0 \ge 0$ (default 0; $> 0$ for ``rule="log"``); may be traced.
      rule: ``"additive"`` (default) or ``"log"``, static.
      step_size: $\delta > 0$ (default $10^{-4}$); may be traced.
      min_entropy_weight: $c_{\min} \ge 0$ (default 0); may be traced.
      max_entropy_weight: $c_{\max}$ (default 0.005), or None for no upper bound; may be
        traced.

    Returns:
      A `Controller`. Its `update` takes `entropy` `[...]` (float), the state and `where`
      `[...]` (True or 1 = counts; None = every entry).

    Examples:
      >>> from tunelib.advantages import adaptive_entropy_controller
      >>> controller = adaptive_entropy_controller(target_entropy=0.2)
      >>> state = controller.init()
      >>> for entropy in (0.15, 0.18, 0.25):
      ...     state = controller.update(entropy, state)
      ...     print(f"{float(state.level):.4f} {float(state.entropy_weight):.4f}")
      0.0001 0.0001
      0.0002 0.0002
      0.0001 0.0000

    References:
      He et al., "Skywork Open Reasoner 1 Technical Report", 2025,
      https://arxiv.org/abs/2505.22312 (code: https://github.com/SkyworkAI/Skywork-OR1).
      Haarnoja et al., "Soft Actor-Critic Algorithms and Applications", 2018,
      https://arxiv.org/abs/1812.05905.
    """
    v.one_of(rule, "rule", _ENTROPY_RULES)
    v.positive_scalar(step_size, "step_size")
    v.non_negative(min_entropy_weight, "min_entropy_weight")
    if rule == "log":
        v.number_in(
            init_entropy_weight,
            "init_entropy_weight",
            low=0,
            low_open=True,
            explain='rule="log" multiplies it',
        )
    else:
        v.non_negative(init_entropy_weight, "init_entropy_weight")
    if max_entropy_weight is not None:
        v.non_negative(max_entropy_weight, "max_entropy_weight")
    bounds = (min_entropy_weight, max_entropy_weight)
    if all(v.is_real_number(b) for b in bounds) and max_entropy_weight < min_entropy_weight:
        raise ValueError(
            f"max_entropy_weight ({max_entropy_weight}) must be >= min_entropy_weight "
            f"({min_entropy_weight})."
        )

    def init() -> EntropyControllerState:
        weight = jnp.asarray(init_entropy_weight, jnp.float32)
        return EntropyControllerState(entropy_weight=weight, level=weight)

    def update(
        entropy: Float[ArrayLike, "*B"],
        state: EntropyControllerState,
        *,
        where: Mask[ArrayLike, "*B"] | None = None,
    ) -> EntropyControllerState:
        measured, ok = _measurement(v.float_array(entropy, "entropy"), where, "entropy")
        target = jnp.asarray(target_entropy, jnp.float32)
        step = jnp.asarray(step_size, jnp.float32)
        below = measured < target
        if rule == "additive":
            level = state.level + jnp.where(below, step, -step)
        else:
            level = state.level * jnp.exp(step * (target - measured))
        high = None if max_entropy_weight is None else jnp.asarray(max_entropy_weight, jnp.float32)
        level = jnp.clip(level, min=jnp.asarray(min_entropy_weight, jnp.float32), max=high)
        weight = jnp.where(below, level, 0.0) if rule == "additive" else level
        return _keep_if(ok, EntropyControllerState(entropy_weight=weight, level=level), state)

    return Controller(init, update)


def running_kto_reference_point(*, average: Average = "ema", decay: Scalar = 0.9) -> Controller:
    r"""KTO's reference point averaged over batches: a running mean of its batch estimates.

    $$
    \hat z_t = \max\!\Big(0,\ \frac{1}{m_t} \sum_{i} \log \frac{\pi_\theta(y'_i \mid x_i)}
        {\pi_{\mathrm{ref}}(y'_i \mid x_i)}\Big), \qquad
    z_1 = \hat z_1, \qquad
    z_{t+1} = \begin{cases}
      \gamma\, z_t + (1 - \gamma)\, \hat z_{t+1} & \texttt{"ema"} \\
      z_t + (\hat z_{t+1} - z_t) / (t + 1) & \texttt{"mean"}
    \end{cases}
    $$

    with $\hat z_t$ the batch estimate of `tunelib.losses.kto_reference_point` (over the
    $m_t$ valid rows of `kl_logps` and `ref_kl_logps`, mismatched completions, and clamped at
    0 per batch), $\gamma$ = `decay`, $t$ the number of batches averaged (`state.count`) and
    $z_t$ = `state.reference_point`, the `reference_point` to pass to
    `tunelib.losses.kto_loss`. The first batch is taken as it is (no bias toward the initial
    0).

    The KTO paper (Ethayarajh et al. 2024) and TRL's `KTOTrainer` estimate the reference point
    from each batch alone, TRL as the mean over the batch gathered from every process,
    clamped at 0; a small batch makes that estimate noisy. This controller keeps a running
    average of the same estimate: ``average="ema"`` (default) an exponential moving average
    with `decay` (default 0.9, about the last 10 batches), which follows the policy as it
    drifts from the reference; ``average="mean"`` the mean of every batch so far.

    `init() -> ReferencePointState(reference_point=0, count=0)`;
    `update(kl_logps, ref_kl_logps, state, *, where=None) -> ReferencePointState`. A batch
    with no valid row, or whose estimate is NaN or infinite (a NaN log-prob at a valid row),
    leaves the state unchanged.

    Args:
      average: ``"ema"`` (default) or ``"mean"``, static.
      decay: $\gamma \in [0, 1]$ for ``"ema"`` (default 0.9); may be traced.

    Returns:
      A `Controller`. Its `update` takes `kl_logps` and `ref_kl_logps` `[B]` (policy and
      reference log-probs of the mismatched completions, as `kto_reference_point`), the state
      and `where` `[B]` (True or 1 = counts; None = every row).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import running_kto_reference_point
      >>> controller = running_kto_reference_point(decay=0.5)
      >>> state = controller.init()
      >>> state = controller.update(jnp.array([-20.0, -18.0]), jnp.array([-21.0, -18.5]), state)
      >>> print(state.reference_point)  # the first batch: 0.75
      0.75
      >>> state = controller.update(jnp.array([-20.0]), jnp.array([-20.25]), state)
      >>> print(state.reference_point, state.count)  # 0.5 * 0.75 + 0.5 * 0.25
      0.5 2

    References:
      Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization", 2024,
      https://arxiv.org/abs/2402.01306.
    """
    v.one_of(average, "average", _AVERAGES)
    v.unit_interval(decay, "decay")

    def init() -> ReferencePointState:
        return ReferencePointState(
            reference_point=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.int32)
        )

    def update(
        kl_logps: Float[ArrayLike, " B"],
        ref_kl_logps: Float[ArrayLike, " B"],
        state: ReferencePointState,
        *,
        where: Mask[ArrayLike, " B"] | None = None,
    ) -> ReferencePointState:
        estimate = kto_reference_point(kl_logps, ref_kl_logps, where=where).astype(jnp.float32)
        rows = jnp.sum(v.mask_array(where, jnp.shape(kl_logps)))
        ok = (rows > 0) & jnp.isfinite(estimate)
        z = state.reference_point
        if average == "ema":
            gamma = jnp.asarray(decay, jnp.float32)
            averaged = gamma * z + (1.0 - gamma) * estimate
        else:
            averaged = z + (estimate - z) / (state.count + 1).astype(jnp.float32)
        new = ReferencePointState(
            reference_point=jnp.where(state.count == 0, estimate, averaged), count=state.count + 1
        )
        return _keep_if(ok, new, state)

    return Controller(init, update)


def reward_normalizer(
    *, center: bool = True, ddof: int = 1, eps: Scalar = 1e-8
) -> RewardNormalizer:
    r"""Running mean and standard deviation of every reward seen, to normalise rewards with.

    `update` folds a batch into the running moments with Chan et al.'s parallel update (the
    batch form of Welford's), and `merge` folds two states together the same way, so states
    updated on separate shards of the data merge into the state of the whole:

    $$
    n = n_a + n_b, \qquad \delta = \mu_b - \mu_a, \qquad
    \mu = \mu_a + \delta \, \frac{n_b}{n}, \qquad
    M_2 = M_{2,a} + M_{2,b} + \delta^2 \, \frac{n_a n_b}{n}
    $$

    with $n$ = `count`, $\mu$ = `mean` and $M_2$ = `m2` (the sum of squared deviations from
    the mean) of a `RunningMomentsState`; `update` computes a batch's $(n_b, \mu_b, M_{2,b})$
    over its valid, finite rewards in two passes. `normalize` maps each reward $r$ to

    $$
    \tilde r = \frac{r - \mu}{\sigma + \epsilon} \quad (\texttt{center=True}), \qquad
    \tilde r = \frac{r}{\sigma + \epsilon} \quad (\texttt{center=False}), \qquad
    \sigma = \sqrt{\frac{M_2}{n - d}}
    $$

    with $\epsilon$ = `eps` and $d$ = `ddof`. Until more than `ddof` rewards have been seen,
    and when $\sigma + \epsilon = 0$ (`eps=0` after equal rewards), $\sigma + \epsilon$ is
    replaced by 1: the rewards are only centred, never divided by 0.

    This is TRL's `RunningMoments` (its PPO trainer's `use_score_scaling`, up to TRL 0.11,
    with `use_score_norm` = `center`): update on the batch first, then normalise the batch
    with the result. TRL uses `ddof=1` and $\epsilon$ = float32 machine epsilon
    ($1.2 \cdot 10^{-7}$; here `eps=1e-8`), and starts from a state with variance 1 and a
    count of $10^{-24}$ rather than from no data.

    Under `jax.jit` with the rewards sharded over devices, `update` reduces over the global
    batch (every device gets the same state). Inside `jax.shard_map`, update a state per
    device from its shard and `merge` the gathered states.

    Rewards that are NaN or infinite (unscorable) and masked rewards are left out of the
    moments and get 0 from `normalize`, with a zero gradient; integer rewards are cast, never
    truncated. A batch with no valid reward leaves the state unchanged.

    Args:
      center: True (default) subtracts the running mean; False only divides by the running
        std. Static.
      ddof: 1 (default, as TRL) or 0, the delta degrees of freedom of $\sigma$. Static.
      eps: $\epsilon \ge 0$ (default $10^{-8}$), added to $\sigma$; may be traced.

    Returns:
      A `RewardNormalizer(init, update, merge, normalize)`. `update` and `normalize` take
      `rewards` `[...]` (float or integer, any shape), the state and `where` `[...]` (True or
      1 = counts; None = every entry); `normalize` returns `[...]` float32 (float64 for
      float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import reward_normalizer
      >>> normalizer = reward_normalizer()
      >>> a = normalizer.update(jnp.array([1.0, 2.0, jnp.nan]), normalizer.init())
      >>> b = normalizer.update(jnp.array([3.0, 4.0, 5.0]), normalizer.init())
      >>> state = normalizer.merge(a, b)  # the moments of [1, 2, 3, 4, 5]
      >>> print(state.count, state.mean, state.m2)
      5 3.0 10.0
      >>> print(normalizer.normalize(jnp.array([1.0, 3.0, jnp.nan]), state).round(4))
      [-1.2649  0.      0.    ]

    References:
      Chan, Golub and LeVeque, "Updating Formulae and a Pairwise Algorithm for Computing
      Sample Variances", 1979, Stanford report STAN-CS-79-773.
      Welford, "Note on a Method for Calculating Corrected Sums of Squares and Products",
      Technometrics 4(3), 1962.
    """
    v.check_ddof(ddof)
    v.non_negative(eps, "eps")
    if not isinstance(center, bool):
        raise TypeError(f"center must be a bool (static), got {center!r}.")

    def init() -> RunningMomentsState:
        zero = jnp.zeros((), jnp.float32)
        return RunningMomentsState(count=jnp.zeros((), jnp.int32), mean=zero, m2=zero)

    def merge(a: RunningMomentsState, b: RunningMomentsState) -> RunningMomentsState:
        count = a.count + b.count
        share_b = b.count.astype(jnp.float32) / jnp.maximum(count, 1).astype(jnp.float32)
        delta = b.mean - a.mean
        mean = a.mean + delta * share_b
        m2 = a.m2 + b.m2 + delta**2 * a.count.astype(jnp.float32) * share_b
        return RunningMomentsState(count=count, mean=mean.astype(a.mean.dtype), m2=m2)

    def update(
        rewards: Real[ArrayLike, "*B"],
        state: RunningMomentsState,
        *,
        where: Mask[ArrayLike, "*B"] | None = None,
    ) -> RunningMomentsState:
        x, valid = v.finite_entries(rewards, where, "rewards")
        count = jnp.sum(valid)
        mean = jnp.sum(x) / jnp.maximum(count, 1).astype(x.dtype)
        m2 = jnp.sum(jnp.where(valid, x - mean, 0.0) ** 2)
        batch = RunningMomentsState(
            count=count.astype(jnp.int32),
            mean=mean.astype(jnp.float32),
            m2=m2.astype(jnp.float32),
        )
        return _keep_if(count > 0, merge(state, batch), state)

    def normalize(
        rewards: Real[ArrayLike, "*B"],
        state: RunningMomentsState,
        *,
        where: Mask[ArrayLike, "*B"] | None = None,
    ) -> Float[Array, "*B"]:
        x, valid = v.finite_entries(rewards, where, "rewards")
        seen = state.count > ddof
        dof = jnp.maximum(state.count - ddof, 1).astype(x.dtype)
        std = jnp.sqrt(jnp.maximum(state.m2.astype(x.dtype), 0.0) / dof)
        scale = std + jnp.asarray(eps, x.dtype)
        scale = jnp.where(seen & (scale > 0), scale, 1.0)
        shifted = x - state.mean.astype(x.dtype) if center else x
        return jnp.where(valid, shifted / scale, 0.0)

    return RewardNormalizer(init, update, merge, normalize)
