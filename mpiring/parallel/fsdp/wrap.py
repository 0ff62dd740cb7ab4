"""Which submodules become units (``auto_wrap``) and which parameters each one owns.

A unit is gathered as one piece, so its size sets the memory of the gathered
parameters: by default every block of the model is one (each child of an
``nn.ModuleList`` or ``nn.Sequential``: a transformer's layers, an MLP's
layers), and whatever is left (embeddings, final norm, head) belongs to the
root unit. ``"blocks"`` does not nest units (a block's children are not
visited); a tuple of classes or a callable does, as torch's ModuleWrapPolicy
and lambda policy do, and a list may name nested modules (a block and its MLP,
as torch's ``fully_shard(block.mlp); fully_shard(block)``): each parameter then
belongs to the innermost unit around it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from torch import nn

#: torch's checkpoint_wrapper's submodule name (``checkpoint_wrapper._CHECKPOINT_PREFIX``).
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."

Policy = str | Callable[[nn.Module], bool] | Sequence | None


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def choose_units(module: nn.Module, auto_wrap: Policy = "blocks") -> list[nn.Module]:
    """The submodules to wrap as units, in module order (the root is not in the list).

    Args:
        module: the model.
        auto_wrap: ``"blocks"`` (each child of a ModuleList or Sequential that has
            parameters), a callable ``f(submodule) -> bool``, a tuple of module
            classes, a list of the submodules themselves, or None (one unit:
            the whole model).

    Raises:
        TypeError: ``auto_wrap`` is none of these.
        ValueError: a listed module is not a submodule of ``module``.
    """
    if auto_wrap is None or auto_wrap is False:
        return []
    if isinstance(auto_wrap, (list,)) and all(isinstance(m, nn.Module) for m in auto_wrap):
        inside = {id(m) for m in module.modules()}
        outside = [type(m).__name__ for m in auto_wrap if id(m) not in inside or m is module]
        if outside:
            raise ValueError(f"auto_wrap lists module(s) {outside} that are not submodules of the "
                             "model: list the model's own submodules (not the model itself)")
        chosen = {id(m) for m in auto_wrap}
        return [m for m in module.modules() if id(m) in chosen]
    # torch's policies wrap inside a wrapped module too ((Block, MLP) gives both);
    # "blocks" stops at a block, whose own lists (a MoE's experts) stay in it.
    nest = auto_wrap != "blocks"
    if auto_wrap == "blocks":
        def pick(m: nn.Module, parent: nn.Module) -> bool:
            return isinstance(parent, (nn.ModuleList, nn.Sequential)) and _has_params(m)
    elif isinstance(auto_wrap, tuple) and all(isinstance(c, type) for c in auto_wrap):
        def pick(m: nn.Module, parent: nn.Module) -> bool:
            return isinstance(m, auto_wrap)
    elif callable(auto_wrap):
        _check_one_argument(auto_wrap, module)

        def pick(m: nn.Module, parent: nn.Module) -> bool:
            return bool(auto_wrap(m))
    else:
        raise TypeError(f"auto_wrap={auto_wrap!r}: use 'blocks', a callable(module) -> bool, a "
                        "tuple of module classes, a list of submodules, or None")
    units: list[nn.Module] = []
    seen: set[int] = set()

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            # A container has no forward of its own to hook: look inside it.
            if not isinstance(child, (nn.ModuleList, nn.ModuleDict)) and pick(child, parent):
                # A module registered at several places (ALBERT's one block applied N
                # times) is one unit: its hooks gather it at each call.
                if id(child) not in seen:
                    seen.add(id(child))
                    units.append(child)
                    if nest:
                        visit(child)
            else:
                visit(child)

    visit(module)
    return units


def _check_one_argument(policy: Callable, module: nn.Module) -> None:
    """Refuse torch's auto-wrap policies, whose call takes ``(module, recurse,
    nonwrapped_numel)``: called with one module they fail with a message about
    ``recurse`` that says nothing of what to pass here."""
    try:
        inspect.signature(policy).bind(module)
    except TypeError:
        raise TypeError(f"auto_wrap={policy!r} is not called as f(module) -> bool (torch's "
                        "auto-wrap policies take (module, recurse, nonwrapped_numel)): for "
                        "torch's ModuleWrapPolicy({Block}) or transformer_auto_wrap_policy "
                        "with transformer_layer_cls={Block} pass auto_wrap=(Block,); else "
                        "auto_wrap=lambda m: <True for a unit>") from None
    except ValueError:  # no signature to read (a builtin): call it as it is
        pass


def assign_parameters(module: nn.Module, units: list[nn.Module]):
    """Every place a parameter is registered, grouped by unit (0 = the root).

    Returns:
        ``(places, shared)``: ``places[u]`` lists ``(submodule, attribute, fqn,
        parameter)`` for unit u (units numbered 1.. in the order of ``units``),
        ``shared`` the names of parameters registered in two different units
        (they cannot be gathered as part of one).
    """
    number = {id(u): i + 1 for i, u in enumerate(units)}
    # Every name a unit is registered under, not only its first: the parameters seen
    # under a second name are still that unit's (else they would look shared with the root).
    unit_prefixes = [(name, number[id(m)])
                     for name, m in module.named_modules(remove_duplicate=False)
                     if id(m) in number]
    places: list[list] = [[] for _ in range(len(units) + 1)]
    owner: dict[int, tuple[int, str]] = {}
    shared: list[str] = []
    for name, m in module.named_modules(remove_duplicate=False):
        # The innermost unit around the module (the longest prefix): units listed nested
        # (a block and its MLP, as fully_shard(block.mlp) then fully_shard(block)) keep
        # their own parameters, as torch's nested units do; the outermost would take them
        # all and leave the inner unit empty, gathering the whole block at once.
        inside = [(len(p), i) for p, i in unit_prefixes if name == p or name.startswith(p + ".")]
        u = max(inside)[1] if inside else 0
        for attr, p in m._parameters.items():
            if p is None:
                continue
            # The model's state_dict key: torch's activation-checkpoint wrapper drops its
            # inner module's name from the keys (a state_dict hook), so drop it here too.
            fqn = (f"{name}.{attr}" if name else attr).replace(_CHECKPOINT_PREFIX, "")
            first = owner.setdefault(id(p), (u, fqn))
            if first[0] != u:
                shared.append(f"{first[1]} / {fqn}")
            places[u].append((m, attr, fqn, p))
    return places, shared
