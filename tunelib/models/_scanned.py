"""Stacked decoder layers (`DecoderConfig.scan_layers`): built per stack and run as one scan per
run of a repeated pattern (`_layer_runs`).

Every layer of one shape: one stack of all $L$ layers, scanned with a body of one layer (of
either kind, sliding or full: each step picks its kind's inputs by a per-layer index). Layers
of several shapes: one stack per position of each run's pattern, and a scan per run whose body
applies the pattern's layers in order, each of one kind. A layer reads and writes its cache
group's keys and values at its index among the group's layers."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunelib.models._block import DecoderLayer
from tunelib.models._config import DecoderConfig
from tunelib.models._per_layer import is_per_layer, layer_at
from tunelib.models._windowed import KindCaches, LayerCache


def stacked_layers(config: DecoderConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The stacked layers of `config`: one `DecoderLayer` stacked `[L, ...]` when every layer
    is of one shape, else an `nnx.List` of one stack per entry of `config.layer_stacks`, each
    `[R, ...]` (layers independently initialised)."""
    stacks = [_stack(config, members, rngs) for members in config.layer_stacks]
    return stacks[0] if len(set(config.layer_shapes)) == 1 else nnx.List(stacks)


def stacks_of(config: DecoderConfig, layers: nnx.Module) -> list[nnx.Module]:
    """The stacks of `layers` (as `stacked_layers` makes them), in `config.layer_stacks` order."""
    return [layers] if len(set(config.layer_shapes)) == 1 else list(layers)


def _stack(config: DecoderConfig, members: tuple[int, ...], rngs: nnx.Rngs) -> DecoderLayer:
    @nnx.split_rngs(splits=len(members))
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, members[0], rngs=rngs)

    return create(rngs)


def run_stacks(config, layers, run, x, inputs, cache, routing):
    """`x` through the stacked `layers`, with `run(layer, x, cos, sin, allowed, fill,
    layer_cache, shared, per_layer_input, routing)` applying one layer; `inputs` maps each
    layer kind (sliding or not) to its `(cos, sin, allowed, fill)`; `cache` is None or
    `(keys, values, index, groups)`. Returns `x`, the new `(keys, values)` or None, and the
    mixture-of-experts layers' `(router logits, experts)` `[M, ...]` in layer order, or None.
    """
    c = config
    keys, values, index, groups = (None,) * 4 if cache is None else cache
    stacks = stacks_of(c, layers)
    kinds = sorted(inputs)
    group_of, member_of = {}, {}
    for g, group in enumerate(groups or ()):
        for j, layer in enumerate(group.members):
            group_of[layer], member_of[layer] = g, j
    moe = [i for i, is_moe in enumerate(c.moe_layers) if is_moe]
    plans = [
        _StackPlan(c, members, kinds, group_of, member_of, moe, groups)
        for members in c.layer_stacks
    ]
    arrays = None if keys is None else tuple(zip(keys, values, strict=True))
    carry, routed, order, first = (x, arrays), [], [], 0
    for layer_run in c.layer_runs:
        count = layer_run.period
        run_plans, run_stacks = plans[first : first + count], stacks[first : first + count]
        first += count
        xs = tuple(plan.scanned(routing) for plan in run_plans)
        carry, outs = _scan(run, run_plans, run_stacks, carry, inputs, index, xs, c.scan_unroll)
        for plan, out in zip(run_plans, outs, strict=True):
            if out is not None:
                routed.append(out)
                order.extend(plan.members)
    x, arrays = carry
    new = None if arrays is None else tuple(map(tuple, zip(*arrays, strict=True)))
    if not routed:
        return x, new, None
    routed = jax.tree.map(lambda *parts: jnp.concatenate(parts), *routed)
    if order != sorted(order):
        routed = jax.tree.map(lambda a: a[np.argsort(order)], routed)
    return x, new, routed


class _StackPlan:
    """What the scan reads for one stack (`members`, its layers): its kind, fixed or per
    layer; its cache group, fixed or per kind (`KindCaches`); each layer's index among its
    group's layers; and its layers' routing, if they are mixtures of experts."""

    def __init__(self, config, members, kinds, group_of, member_of, moe, groups):
        self.members = members
        layer_kinds = {config.sliding_layers[i] for i in members}
        self.kind = layer_kinds.pop() if len(layer_kinds) == 1 else None
        self.kind_ids = np.asarray([kinds.index(config.sliding_layers[i]) for i in members])
        self.groups = None if groups is None else sorted({group_of[i] for i in members})
        self.group_of_kind = None
        if self.groups is not None and len(self.groups) > 1:
            # Layers of two kinds with a cache group each (a ring and a full cache).
            self.group_of_kind = [
                next(group_of[i] for i in members if config.sliding_layers[i] == k) for k in kinds
            ]
            self.ringed = [groups[g].window is not None for g in self.group_of_kind]
        elif self.groups is not None:
            self.ringed = groups[self.groups[0]].window is not None
        self.member_ids = None if groups is None else np.asarray([member_of[i] for i in members])
        self.moe = config.moe_layers[members[0]]
        self.moe_ids = [moe.index(i) for i in members] if self.moe else None

    def scanned(self, routing):
        """The per-layer arrays scanned over: `(position in the stack, kind, member index,
        routing)`."""
        replayed = None
        if routing is not None and self.moe:
            ids = self.moe_ids
            replayed = routing if ids == list(range(routing.shape[0])) else routing[np.asarray(ids)]
        member_ids = None if self.member_ids is None else jnp.asarray(self.member_ids)
        kind_ids = None if self.kind is not None else jnp.asarray(self.kind_ids)
        return jnp.arange(len(self.members)), kind_ids, member_ids, replayed

    def inputs(self, inputs, kind):
        """`(cos, sin, allowed, fill)` of this layer: its kind's, or picked by `kind`
        (traced); for a cache of two groups, `allowed` and `fill` are pairs (full, sliding)."""
        if self.kind is not None:
            return inputs[self.kind]
        kinds = sorted(inputs)
        if self.group_of_kind is None:
            table = jax.tree.map(lambda *parts: jnp.stack(parts), *(inputs[k] for k in kinds))
            return jax.tree.map(lambda x: x[kind], table)
        rope = jax.tree.map(lambda *parts: jnp.stack(parts), *(inputs[k][:2] for k in kinds))
        masks = zip(*(inputs[k][2:] for k in kinds), strict=True)
        return (*jax.tree.map(lambda x: x[kind], rope), *masks)

    def cache(self, arrays, member, kind, index):
        """This layer's `LayerCache` (or `KindCaches`) in the cache `arrays`."""
        if self.group_of_kind is None:
            return LayerCache(*arrays[self.groups[0]], member, index, ring=self.ringed)
        caches = tuple(
            LayerCache(*arrays[g], member, index, ring=ring)
            for g, ring in zip(self.group_of_kind, self.ringed, strict=True)
        )
        return KindCaches(caches, kind)

    def written(self, arrays, layer_cache):
        """`arrays` with this layer's cache written back."""
        arrays = list(arrays)
        if self.group_of_kind is None:
            arrays[self.groups[0]] = (layer_cache.keys, layer_cache.values)
        else:
            for g, kind_cache in zip(self.group_of_kind, layer_cache.caches, strict=True):
                arrays[g] = (kind_cache.keys, kind_cache.values)
        return tuple(arrays)


def _scan(run, plans, stacks, carry, inputs, index, xs, unroll):
    """One scan over the repeats of a run: its stacks' layers in order at each step, `unroll`
    steps to one step of the loop. Stacks in the decoding layout (`_per_layer`) are read per
    layer from their state."""

    def through(carry, layers, xs):
        x, arrays = carry
        outs = []
        for plan, layer, (_, kind, member, routing) in zip(plans, layers, xs, strict=True):
            cos, sin, allowed, fill = plan.inputs(inputs, kind)
            layer_cache = None if arrays is None else plan.cache(arrays, member, kind, index)
            x, layer_cache, routed, _ = run(
                layer, x, cos, sin, allowed, fill, layer_cache, None, None, routing
            )
            if arrays is not None:
                arrays = plan.written(arrays, layer_cache)
            outs.append(routed)
        return (x, arrays), tuple(outs)

    split = [nnx.split(stack) for stack in stacks]
    leaves = [leaf for _, s in split for leaf in jax.tree.leaves(s, is_leaf=is_per_layer)]
    if any(map(is_per_layer, leaves)):
        # Parameters of `decoding_layout`: each step builds its layers from their state,
        # reading the per-layer weights in place (`_per_layer`).
        def select(carry, xs):
            layers = [nnx.merge(g, layer_at(s, x[0])) for (g, s), x in zip(split, xs, strict=True)]
            return through(carry, layers, xs)

        return jax.lax.scan(select, carry, xs, unroll=unroll)
    scan = nnx.scan(
        through,
        unroll=unroll,
        in_axes=(nnx.Carry, 0, 0),
        out_axes=(nnx.Carry, 0),
        transform_metadata={nnx.PARTITION_NAME: "layers"},
    )
    return scan(carry, tuple(stacks), xs)
