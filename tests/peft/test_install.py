"""`tunelib.peft` teaches Quax its two rules on the first wrapped call, never at import."""

import importlib
import sys

import jax
import jax._src.core as core
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import remat_p
from quax import _dispatch, _trace

import tunelib
from tests._helpers import own_checks

TRACE = _trace._QuaxTrace


def is_peft(name: str) -> bool:
    return name == "tunelib.peft" or name.startswith("tunelib.peft.")


@pytest.fixture
def bare_quax():
    """Quax without tunelib's rules and `tunelib.peft` not yet imported; restored after.

    Earlier tests of the session may have installed the rules and imported the package, so
    both are taken out here and put back afterwards, with the same module objects. Runtime
    type checking is off meanwhile: it would compare the new module's classes with the
    cached checks of the old ones.
    """
    own = TRACE.__dict__.get("process_custom_vjp_call")
    rules = dict(_dispatch._rules)
    modules = {name: module for name, module in sys.modules.items() if is_peft(name)}
    package_attribute = tunelib.__dict__.get("peft")
    if own is not None:
        delattr(TRACE, "process_custom_vjp_call")
    _dispatch._rules.pop(remat_p, None)
    _dispatch._dispatch_cache.clear()
    for name in modules:
        del sys.modules[name]
    tunelib.__dict__.pop("peft", None)
    try:
        with own_checks():
            yield
    finally:
        for name in [name for name in sys.modules if is_peft(name)]:
            del sys.modules[name]
        sys.modules.update(modules)
        if package_attribute is not None:
            tunelib.peft = package_attribute
        _dispatch._rules.clear()
        _dispatch._rules.update(rules)
        _dispatch._dispatch_cache.clear()
        if own is not None:
            TRACE.process_custom_vjp_call = own
        elif "process_custom_vjp_call" in TRACE.__dict__:
            delattr(TRACE, "process_custom_vjp_call")


def test_import_changes_nothing_and_the_first_wrapped_call_installs_the_rules(bare_quax):
    assert TRACE.process_custom_vjp_call is core.Trace.process_custom_vjp_call
    peft = importlib.import_module("tunelib.peft")
    assert TRACE.process_custom_vjp_call is core.Trace.process_custom_vjp_call
    assert remat_p not in _dispatch._rules
    transforms = sys.modules["tunelib.peft._transforms"]

    params = {"w": jnp.ones((3, 2))}
    adapters = {"w": peft.LoraAdapter(a=jnp.ones((3, 1)), b=jnp.ones((1, 2)), alpha=1.0)}

    @jax.custom_vjp
    def scaled(x):
        return 2.0 * x

    scaled.defvjp(lambda x: (2.0 * x, None), lambda _, g: (2.0 * g,))

    def forward(params, x):  # a custom VJP and a remat region, both need the rules
        return jax.checkpoint(lambda x: scaled(x @ params["w"]))(x)

    wrapped = peft.lora(forward)
    assert remat_p not in _dispatch._rules  # wrapping is not calling
    out = wrapped(peft.apply_lora(params, adapters), jnp.ones((1, 3)))
    np.testing.assert_allclose(out, [[12.0, 12.0]])  # 2 * (x W + x A B) = 2 * (3 + 3)
    assert TRACE.process_custom_vjp_call is transforms._process_custom_vjp_call
    assert remat_p in _dispatch._rules
    methods = len(_dispatch._rules[remat_p].methods)
    wrapped(peft.apply_lora(params, adapters), jnp.ones((1, 3)))
    assert len(_dispatch._rules[remat_p].methods) == methods  # installed once
